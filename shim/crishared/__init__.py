"""What the CRI proxy (``shim.cri``) and the two sides of rerouting (``shim.origin``, ``shim.shadowhost``) share.

Named for what it is, shared by the CRI programs, so that none of the three
imports another: the proxy never imports a side, the sides never import
each other, and this package imports none of them. ``labels`` and ``mark``
are how a host knows its shadows (the list verbs hide them); ``remote`` is a
rerouted container as kubelet sees it and ``attempt`` one opted-in
CreateContainer (the verbs answer from them, the origin side makes them);
``netns``, ``kernel_path`` and ``baseline`` are the pod network and the
runtime baseline both sides of a rerouted container use.
"""
