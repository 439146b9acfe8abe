"""``python -m shim`` runs the ``weft`` command line."""

from shim.cli import main

raise SystemExit(main())
