"""``weft bench``: benchmarks that measure two sides in one run and print their ratios.

Each runs on this machine, most on the local fabric (:mod:`shim.localfabric`);
the latest figures are in ``bench/results/`` and ``docs/benchmarks.md``.
"""
