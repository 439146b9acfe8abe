"""The fleet simulator behind ``weft simulate``: bundled pods against weft on one workload, in one run.

weft's promise is fleet GPU utilisation, measured with and without weft by a
simulator that uses the agent's own decision code. This package replays a
workload (built from public traces or drawn synthetically) through a
discrete-event model of a cluster once per mode: as Kubernetes places bundled
pods today, as KAI scheduler's GPU fractions share GPUs without a memory
limit, and as weft splits them; every classification, placement, reroute and
packing decision in the weft runs is made by ``shim.core`` itself, and the
KAI run packs its shares with the same code.

Modules, in the order data flows: :mod:`.traces` reads the CSV files,
:mod:`.workload` turns them into pods, :mod:`.engine` runs the events,
:mod:`.metrics` sums a run up, :mod:`.validate` checks the bundled run
against the published figures, :mod:`.report` writes the results and
:mod:`.plots` the figures; :mod:`.cli` is ``weft simulate``. The model's
assumptions are listed once, in :mod:`.assumptions`, so the code, the report
and ``--help`` say the same thing.
"""
