"""Test and benchmark harnesses; not used by jobs.

Small real multi-rank workloads and synthetic data that the tests under ``tests/`` and the scripts under
``benchmarks/`` share. Nothing else in ``hpc_tools`` or ``profiling`` imports this package (``tests/unit/
test_import_graph.py`` checks it).
"""
