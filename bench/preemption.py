"""``python -m bench.preemption`` runs the benchmark where it lives, ``shim/bench/checkout/preemption.py``."""

import runpy

if __name__ == "__main__":
    runpy.run_module("shim.bench.checkout.preemption", run_name="__main__", alter_sys=True)
