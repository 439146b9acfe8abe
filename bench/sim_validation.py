"""``python -m bench.sim_validation`` runs the benchmark where it lives, ``shim/bench/checkout/sim_validation.py``."""

import runpy

if __name__ == "__main__":
    runpy.run_module("shim.bench.checkout.sim_validation", run_name="__main__", alter_sys=True)
