"""The benchmarks run from a checkout, not from an installed weft (the wheel leaves this package out): those that
need the test cluster (``harness``: ``preemption``, ``day_two`` and ``kueue``, the last two gathering the figures
integration scenarios write, ``scenarios``), the simulation checked against the local fabric's real agents
(``sim_validation``), an opted-in pod's start taken apart (``start_steps``) and the GPU node's runs
(``gpu_whole_path``, ``gpu_value`` and its workload ``gpu_workload``, run by ``scripts/gpu-proof.sh``).

Each is run as ``python -m bench.X`` (``bench/X.py`` runs this package's module of that name); its figures go
under ``bench/results/``. Only this package imports the harness, and nothing of the shipped benchmarks
(``shim.bench``) or the rest of weft imports this package (both are contracts in ``pyproject.toml``).
"""
