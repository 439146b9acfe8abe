"""The fault suite: a fault injected during a running workload, then the fabric's invariants checked.

Every test drives the three-node fabric (``shim.localfabric.fabric``) through the
origin's CRI socket as kubelet would (``checks.Kubelet``), injects one fault
(kill -9 of a process at a step of the container lifecycle, a cut or lossy
link, a rebooted host, a full disk, a skewed clock) and, once things settle,
runs ``checks.settled``: nothing kubelet created silently vanished, no lease
or shadow leaked, and never two live copies (``checks.LiveCopies`` watches
that continuously while the fault lasts). The README's "Faults" section is
the table of faults and outcomes.
"""
