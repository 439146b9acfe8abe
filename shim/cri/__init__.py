"""The CRI proxy: what kubelet talks to instead of containerd.

``routes`` is the complete table of intercepted methods; everything else is
forwarded as raw bytes by ``passthrough``. ``instrument`` wraps every handler
(latency, logs, error mapping) and ``server`` puts it on a unix socket.
"""
