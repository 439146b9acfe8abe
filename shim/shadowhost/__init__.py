"""The host's side of rerouting: shadow sandboxes and containers run for a peer's pod.

``shadows`` runs them through this node's containerd, ``logs`` follows their
log files for the origin, ``tunnel`` carries streams and the stitched pod
network into them, ``volumes`` holds their copied read-only volumes.
"""
