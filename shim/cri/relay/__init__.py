"""The data path: an HTTP/2 relay between kubelet and containerd that passes frames through verbatim."""
