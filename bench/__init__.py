"""Benchmarks run from a checkout (``python -m bench.X``), not from an installed weft: those that need the test
cluster (``integration/``), and the simulation checked against the local fabric's real agents
(``bench.sim_validation``).

The benchmarks a user runs from an installed weft are ``weft bench`` (``shim/bench``); figures of both are
written under ``bench/results/`` and described in ``docs/benchmarks.md``.
"""
