"""The agent's access to the Kubernetes API: where its credentials come from, and how they stay fresh.

The agent runs as a host service, not in a pod, so it has no service-account
token of its own. The DaemonSet's long-running container keeps one for it
(``credentials``: a kubeconfig under ``/etc/weft/`` whose token it renews
through the TokenRequest API); ``access`` decides, once at start, what the
agent uses: that kubeconfig, in-cluster configuration, or no API at all.
"""
