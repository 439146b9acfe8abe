// Command weft-test-dra-driver is a minimal DRA driver for weft's integration tests: it publishes a
// node's simulated GPUs as one ResourceSlice and, for each prepared claim, writes a CDI spec whose
// devices name their GPU by UUID in the container's environment. The UUIDs are the ones the node's
// GPU broker reports (--gpus), so the driver and the broker agree by configuration.
//
// The upstream example driver (sigs.k8s.io/dra-example-driver) is not served by the Go module proxy
// these machines use; this one does what the tests need of it and nothing more.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
)

// cdiClass is not "gpu": weft must recognise a claim's device by its CDI spec, not by its name.
const cdiClass = "claim"

type driver struct {
	name   string
	cdiDir string
	uuids  map[string]string // device name in the slice -> GPU UUID
}

func deviceName(i int) string { return fmt.Sprintf("gpu-%d", i) }

func (d *driver) specPath(claim types.UID) string {
	return filepath.Join(d.cdiDir, fmt.Sprintf("%s-%s.json", d.name, claim))
}

type cdiDevice struct {
	Name           string         `json:"name"`
	ContainerEdits map[string]any `json:"containerEdits"`
}

type cdiSpec struct {
	Version string      `json:"cdiVersion"`
	Kind    string      `json:"kind"`
	Devices []cdiDevice `json:"devices"`
}

func (d *driver) PrepareResourceClaims(ctx context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	out := make(map[types.UID]kubeletplugin.PrepareResult, len(claims))
	for _, claim := range claims {
		out[claim.UID] = d.prepare(claim)
	}
	return out, nil
}

func (d *driver) prepare(claim *resourceapi.ResourceClaim) kubeletplugin.PrepareResult {
	if claim.Status.Allocation == nil {
		return kubeletplugin.PrepareResult{Err: fmt.Errorf("claim %s is not allocated", claim.Name)}
	}
	spec := cdiSpec{Version: "0.5.0", Kind: d.name + "/" + cdiClass}
	var devices []kubeletplugin.Device
	for _, r := range claim.Status.Allocation.Devices.Results {
		if r.Driver != d.name {
			continue
		}
		uuid, ok := d.uuids[r.Device]
		if !ok {
			return kubeletplugin.PrepareResult{Err: fmt.Errorf("claim %s: no device %s on this node", claim.Name, r.Device)}
		}
		// The claim's UID in the name: a CDI name is never reused, so no runtime's cached spec is stale.
		name := fmt.Sprintf("%s-%s", claim.UID, r.Device)
		env := fmt.Sprintf("WEFT_DRA_%s=%s", strings.ToUpper(strings.ReplaceAll(r.Device, "-", "_")), uuid)
		spec.Devices = append(spec.Devices, cdiDevice{Name: name, ContainerEdits: map[string]any{"env": []string{env}}})
		devices = append(devices, kubeletplugin.Device{Requests: []string{r.Request}, PoolName: r.Pool,
			DeviceName: r.Device, CDIDeviceIDs: []string{spec.Kind + "=" + name}})
	}
	data, err := json.MarshalIndent(spec, "", " ")
	if err == nil {
		err = writeAtomic(d.specPath(claim.UID), data)
	}
	if err != nil {
		return kubeletplugin.PrepareResult{Err: err}
	}
	return kubeletplugin.PrepareResult{Devices: devices}
}

func writeAtomic(path string, data []byte) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path) // a runtime never reads half a spec
}

func (d *driver) UnprepareResourceClaims(ctx context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	out := make(map[types.UID]error, len(claims))
	for _, claim := range claims {
		err := os.Remove(d.specPath(claim.UID))
		if errors.Is(err, os.ErrNotExist) {
			err = nil // unprepare is idempotent
		}
		out[claim.UID] = err
	}
	return out, nil
}

func (d *driver) HandleError(ctx context.Context, err error, msg string) {
	klog.FromContext(ctx).Error(err, msg)
	if !errors.Is(err, kubeletplugin.ErrRecoverable) {
		os.Exit(1)
	}
}

func main() {
	var (
		driverName   = flag.String("driver-name", "gpu.weft.test", "the DRA driver's name (and its CDI vendor)")
		nodeName     = flag.String("node-name", "", "the node whose GPUs are published")
		kubeconfig   = flag.String("kubeconfig", "", "kubeconfig to publish ResourceSlices and read claims with")
		gpus         = flag.String("gpus", "", "the node's GPU UUIDs, comma-separated, in index order")
		cdiDir       = flag.String("cdi-dir", "/var/run/cdi", "where the container runtime reads CDI specs")
		pluginDir    = flag.String("plugin-dir", "", "the driver's directory in kubelet's plugins directory")
		registrarDir = flag.String("registrar-dir", "", "kubelet's plugin registry directory")
	)
	klog.InitFlags(nil)
	flag.Parse()
	if *nodeName == "" || *kubeconfig == "" || *gpus == "" || *pluginDir == "" || *registrarDir == "" {
		fmt.Fprintln(os.Stderr, "weft-test-dra-driver: --node-name, --kubeconfig, --gpus, --plugin-dir and --registrar-dir are needed")
		os.Exit(2)
	}
	if err := run(*driverName, *nodeName, *kubeconfig, strings.Split(*gpus, ","), *cdiDir, *pluginDir, *registrarDir); err != nil {
		fmt.Fprintln(os.Stderr, "weft-test-dra-driver:", err)
		os.Exit(1)
	}
}

func run(name, node, kubeconfig string, gpus []string, cdiDir, pluginDir, registrarDir string) error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return err
	}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	for _, dir := range []string{cdiDir, pluginDir, registrarDir} {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
	}
	d := &driver{name: name, cdiDir: cdiDir, uuids: map[string]string{}}
	var devices []resourceapi.Device
	for i, uuid := range gpus {
		d.uuids[deviceName(i)] = uuid
		devices = append(devices, resourceapi.Device{
			Name: deviceName(i),
			Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
				"uuid":  {StringValue: ptr.To(uuid)},
				"index": {IntValue: ptr.To(int64(i))},
			},
		})
	}
	helper, err := kubeletplugin.Start(ctx, d, kubeletplugin.DriverName(name), kubeletplugin.NodeName(node),
		kubeletplugin.KubeClient(client), kubeletplugin.PluginDataDirectoryPath(pluginDir),
		kubeletplugin.RegistrarDirectoryPath(registrarDir))
	if err != nil {
		return err
	}
	defer helper.Stop()
	resources := resourceslice.DriverResources{Pools: map[string]resourceslice.Pool{
		node: {Slices: []resourceslice.Slice{{Devices: devices}}},
	}}
	if err := helper.PublishResources(ctx, resources); err != nil {
		return err
	}
	klog.InfoS("publishing", "driver", name, "node", node, "devices", len(devices))
	go reportRegistration(ctx, helper)
	<-ctx.Done()
	return nil
}

// reportRegistration says once when kubelet has registered the plugin: a pod whose claim kubelet
// prepares before that waits out kubelet's retry back-off, so the tests wait for this line first.
func reportRegistration(ctx context.Context, helper *kubeletplugin.Helper) {
	ticker := time.NewTicker(100 * time.Millisecond)
	defer ticker.Stop()
	for {
		if status := helper.RegistrationStatus(); status != nil {
			if status.PluginRegistered {
				fmt.Fprintln(os.Stderr, "weft-test-dra-driver: registered with kubelet")
				return
			}
			fmt.Fprintln(os.Stderr, "weft-test-dra-driver: kubelet refused the registration:", status.Error)
		}
		select {
		case <-ctx.Done():
			return
		case <-ticker.C:
		}
	}
}
