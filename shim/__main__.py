"""``python -m shim`` runs the ``weft`` command line."""

from shim import stopping

stopping.end_at_once()  # first: a container's PID 1 ignores a SIGTERM it has no handler for (shim.stopping)

from shim.cli import main  # noqa: E402 - after it: importing the command line takes time

raise SystemExit(main())
