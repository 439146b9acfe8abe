"""weft: an execution fabric beneath the Kubernetes scheduler.

The ``shim`` package is the node agent: the CRI proxy kubelet talks to, and
(in later layers) placement, the peer mesh, the GPU broker, the state store,
metrics and the ``weft`` command line. ``shim.core`` holds the pure decisions
that the agent and the simulator share.
"""

__version__ = "0.1.0"
