"""``weft report``: did opting a workload in to weft pay off, measured from the cluster's own Prometheus.

The package is split so that everything that decides is pure and tested on
its own: :mod:`model` (values), :mod:`workload` and :mod:`windows` (what the
user asked for), :mod:`compute` (integrals, costs), :mod:`verdict` (the
rule), :mod:`render` (table, markdown, JSON). Prometheus is behind the
:class:`~shim.report.source.Source` protocol (:mod:`prom` talks HTTP, the
in-package :class:`~shim.report.source.FakeSource` serves unit tests), and
:mod:`cli` is the only module that reads the agent's state directory.
"""
