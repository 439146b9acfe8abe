"""The origin's side of rerouting: containers kubelet asked for here that run on a host.

``shim.crishared.remote`` keeps them as kubelet sees them (the verbs read it
too), ``place`` chooses their host, ``prepare`` asks one for a pod's shadow
sandbox ahead, ``supervisor`` follows them (status, loss, logs, volumes),
``stitch`` joins them to their pod's localhost, ``stream_relay`` carries exec
and attach; ``context.Origin`` holds these parts for the verbs, which reach
it only through ``shim.crishared.sides.OriginSide`` (``settings`` is what
they all read).
"""
