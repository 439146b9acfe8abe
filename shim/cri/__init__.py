"""The CRI proxy: what kubelet talks to instead of containerd.

A call flows relay -> route -> instrumentation -> verb -> pass-through:
``relay`` passes kubelet's HTTP/2 frames to containerd verbatim and looks up
each request's path in the route table (``verbs.routes``); a path weft
intercepts is run through ``instrument`` (latency, log line, error mapping)
by its verb module in ``verbs``, which answers with ``passthrough``'s grpcio
client to containerd where it needs containerd. The two sides of rerouting
are packages of their own beside this one: ``shim.origin`` (a node whose
containers run elsewhere), which the verbs reach through ``Fabric.origin``,
and ``shim.shadowhost`` (the node that runs them), which the mesh server
calls; what the three share is in ``shim.crishared``.
"""
