"""``python -m bench.day_two`` runs the benchmark where it lives, ``shim/bench/checkout/day_two.py``."""

import runpy

if __name__ == "__main__":
    runpy.run_module("shim.bench.checkout.day_two", run_name="__main__", alter_sys=True)
