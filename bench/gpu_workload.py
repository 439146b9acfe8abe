"""``python -m bench.gpu_workload`` runs the benchmark where it lives, ``shim/bench/checkout/gpu_workload.py``."""

import runpy

if __name__ == "__main__":
    runpy.run_module("shim.bench.checkout.gpu_workload", run_name="__main__", alter_sys=True)
