"""A local fabric on network namespaces: test nodes, each with its own containerd and weft agent, on one machine.

It is what ``weft demo`` and ``weft bench`` run on, and what the integration
tests build on: real containerd and runc, each node a network namespace with
its own CNI bridge, joined to the others by veth links. It needs root.
"""
