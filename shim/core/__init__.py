"""Pure decisions: no gRPC, sqlite3, pynvml, pyroute2, subprocess or sockets.

Classification, placement, packing, leases and fencing live here so that the
agent and the fleet simulator run the very same code; import-linter keeps
I/O out (see ``pyproject.toml``).
"""
