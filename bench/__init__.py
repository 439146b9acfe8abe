"""Benchmarks that need the test cluster (``integration/``), so they run from a checkout: ``python -m bench.X``.

The benchmarks a user runs from an installed weft are ``weft bench`` (``shim/bench``); figures of both are
written under ``bench/results/`` and described in ``docs/benchmarks.md``.
"""
