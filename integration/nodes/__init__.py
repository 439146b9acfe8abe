"""The cluster of real nodes, tested: the nodes themselves (``test_nodes.py``) and day one and two on them
(``test_kube_day_one.py``). The nodes and their cluster are the harness's (``harness/nodes``)."""
