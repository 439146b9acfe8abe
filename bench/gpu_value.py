"""``python -m bench.gpu_value`` runs the benchmark where it lives, ``shim/bench/checkout/gpu_value.py``."""

import runpy

if __name__ == "__main__":
    runpy.run_module("shim.bench.checkout.gpu_value", run_name="__main__", alter_sys=True)
