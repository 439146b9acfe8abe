"""Benchmarks that measure weft against containerd side by side in one run.

They live in the source checkout, next to integration/, because they drive a
throwaway containerd from the integration harness; the node image does not
ship them. ``weft bench proxy`` runs :mod:`bench.proxy`.
"""
