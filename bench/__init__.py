"""``python -m bench.X``: the names the checkout's benchmarks are run by, each running its module in
``shim/bench/checkout`` (where they live, beside the shipped ``weft bench`` ones in ``shim/bench``, and out of the
wheel); and their figures, with those of ``weft bench``, under ``bench/results/`` (``docs/benchmarks.md``).
"""
