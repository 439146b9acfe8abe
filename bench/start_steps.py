"""``python -m bench.start_steps`` runs the benchmark where it lives, ``shim/bench/checkout/start_steps.py``."""

import runpy

if __name__ == "__main__":
    runpy.run_module("shim.bench.checkout.start_steps", run_name="__main__", alter_sys=True)
