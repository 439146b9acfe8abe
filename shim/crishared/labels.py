"""The labels and annotations by which a host knows the shadows it runs for its peers.

A shadow sandbox or container carries ``weft.io/origin-node``; the rest tie it
to the origin's container (its key), the origin's sandbox, and what the host
admitted it with.
"""

ORIGIN_LABEL = "weft.io/origin-node"
KEY_LABEL = "weft.io/origin-key"
SANDBOX_LABEL = "weft.io/origin-sandbox"
KEY_ANNOTATION = "weft.io/origin-key-full"
CPU_LIMIT_ANNOTATION = "weft.io/hosted-cpu-limit"  # cores, as admitted
MEMORY_LIMIT_ANNOTATION = "weft.io/hosted-memory-limit"  # bytes
CPU_SHARES_ANNOTATION = "weft.io/hosted-cpu-shares"  # the CPU weight it was made with (cgroup v1 shares)
# "QUOTA PERIOD": the CPU limit a shadow is made without and given once it runs (shim.shadowhost.lifecycle).
CPU_MAX_ANNOTATION = "weft.io/hosted-cpu-max"
# The origin's pod (UID and sandbox attempt, digested) on a shadow sandbox: a sandbox prepared before the
# origin's sandbox ID was known is found by it.
POD_LABEL = "weft.io/origin-pod"
