"""The per-node GPU broker: a separate process, so a hung NVML call never stalls CRI.

``backend`` is the I/O boundary (NVML or simulated), ``service`` the gRPC API of
``proto/broker.proto``, ``store`` the leases on disk, ``watchdog`` enforcement,
``mps`` the CUDA MPS control daemons.
"""
