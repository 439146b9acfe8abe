"""``python -m bench.gpu_whole_path`` runs the benchmark where it lives, ``shim/bench/checkout/gpu_whole_path.py``."""

import runpy

if __name__ == "__main__":
    runpy.run_module("shim.bench.checkout.gpu_whole_path", run_name="__main__", alter_sys=True)
