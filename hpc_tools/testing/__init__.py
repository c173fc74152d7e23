"""Test and benchmark harnesses; not used by jobs.

Small real multi-rank workloads and synthetic data that the tests under ``tests/`` and the scripts under
``benchmarks/`` share. Nothing else in ``hpc_tools`` or ``profiling`` imports this package (the ``harnesses``
import-linter contract in setup.cfg, checked by ``tests/unit/test_layers.py``).
"""
