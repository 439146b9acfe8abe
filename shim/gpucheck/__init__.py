"""``weft gpu-check``: can this node enforce GPU leases, and does it?

A preflight for operators and the proof of the broker on real hardware, in
one command. ``inventory`` reads NVML (driver, CUDA driver, each device's
memory, MIG, compute mode, persistence); ``mps`` checks that the MPS control
binary runs and takes server-side limits; ``deviceplugin`` reads what the
node's GPU device plugin (or DRA driver) advertises and whether that lets
weft pack several pods onto one GPU; ``live`` leases two shares of one GPU
through the broker and runs ``cuda_client`` in each. Every check is a value
(``report.Check``: ok, warn or fail, with what to change), and nothing here
changes a device setting: it reads them and says what an operator would
change.
"""
