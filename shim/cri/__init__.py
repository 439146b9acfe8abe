"""The CRI proxy: what kubelet talks to instead of containerd.

A call flows relay -> route -> instrumentation -> verb -> pass-through:
``relay`` passes kubelet's HTTP/2 frames to containerd verbatim and looks up
each request's path in the route table (``verbs.routes``); a path weft
intercepts is run through ``instrument`` (latency, log line, error mapping)
by its verb module in ``verbs``, which answers with ``passthrough``'s grpcio
client to containerd where it needs containerd. ``origin`` is the side of a
node whose containers run elsewhere (remote containers, their placement, the
stitched pod network, the streaming relay); ``host`` is the side that runs
them (shadows, their logs, tunnels and volumes).
"""
