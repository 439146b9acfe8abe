"""The host installer: weft onto a node as systemd services, kubelet switched to the agent, all undoable.

``plan``, ``containerd``, ``kubelet`` and ``tomlw`` are pure (host files in,
bytes out); ``host`` (atomic files, journal, backups), ``services``
(systemctl, health checks), ``bundle`` (the self-contained copy) do the I/O;
``phases`` is the steps, one table of phases (apply, undo, what each journals and checks); ``run`` walks
it both ways around the journal; ``cli`` is the command line. Why host services and not a pod:
docs/design.md.
"""
