"""What a restart must not lose: SQLite (stdlib ``sqlite3``, WAL) under the state directory.

``db`` opens a database and applies its versioned migrations; ``agent`` holds
opted-in sandboxes and container placements, ``leases`` the broker's GPU
leases. Every fact is committed before the call that created it returns.
"""
