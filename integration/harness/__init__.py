"""The integration tests' own harness, in one place: a real Kubernetes cluster (etcd, kube-apiserver,
kube-scheduler and kubelets: ``cluster.KubeCluster``) and the helpers the tests share (kubectl, leak checks, a
Prometheus history, a recording upstream, a local registry). The product's local fabric, which the tests and
``weft demo`` and ``weft bench`` stand on, stays in ``shim/localfabric``; the tests, in folders by the subsystem
they exercise, are beside this folder.

The components are built from Go modules by ``components/build.sh`` (pins in ``components/versions.env``); the
nodes are the local fabric's network-namespace nodes, each with its own containerd and ``weft agent``
as kubelet's runtime and image endpoint.
"""
