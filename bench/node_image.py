"""``python -m bench.node_image`` runs the benchmark where it lives, ``shim/bench/checkout/node_image.py``."""

import runpy

if __name__ == "__main__":
    runpy.run_module("shim.bench.checkout.node_image", run_name="__main__", alter_sys=True)
