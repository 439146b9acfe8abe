"""The CRI proxy: what kubelet talks to instead of containerd.

``relay`` is the data path: kubelet's HTTP/2 frames pass to containerd
verbatim. ``routes`` is the complete table of intercepted methods, one module
per verb, answered by weft with ``passthrough``'s grpcio client to containerd;
``instrument`` measures and logs every call and maps weft's errors to gRPC
statuses; ``h2`` holds the little HTTP/2 framing the relay needs.
"""
