"""A real Kubernetes cluster for the integration tests: etcd, kube-apiserver, kube-scheduler and kubelets.

The components are built from Go modules by ``components/build.sh`` (pins in ``components/versions.env``); the
nodes are the local fabric's network-namespace nodes, each with its own containerd and ``weft agent``
as kubelet's runtime and image endpoint. ``cluster.KubeCluster`` puts it together.
"""
