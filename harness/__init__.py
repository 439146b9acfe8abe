"""The test harness, apart from the tests: a real Kubernetes cluster (etcd, kube-apiserver, kube-scheduler and
kubelets: ``cluster.KubeCluster``), the cluster of nodes booted with systemd (``nodes``) and the helpers the tests
and the checkout's benchmarks share (kubectl, leak checks, a Prometheus history, a recording upstream, a local
registry). The tests (``integration/``) and the benchmarks run from a checkout (``shim/bench/checkout``) import
it; it imports neither. The product's local fabric, which the tests and ``weft demo`` and ``weft bench`` stand on,
stays in ``shim/localfabric``; like the tests, this is not part of the installed product.

The components are built from Go modules by ``components/build.sh`` (pins in ``components/versions.env``); the
nodes are the local fabric's network-namespace nodes, each with its own containerd and ``weft agent``
as kubelet's runtime and image endpoint.
"""
