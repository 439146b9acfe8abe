"""``python -m bench.kueue`` runs the benchmark where it lives, ``shim/bench/checkout/kueue.py``."""

import runpy

if __name__ == "__main__":
    runpy.run_module("shim.bench.checkout.kueue", run_name="__main__", alter_sys=True)
