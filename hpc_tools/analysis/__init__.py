"""Post-run analysis: per-run and per-rank metrics from step records, sweep tables, scaling fits, reports.

Pipeline: ``inputs.discover`` (run / sweep folders) -> ``records.read_run`` (per-rank reduction while reading, never
the whole trace, by ``profiling.figures``, which defines every figure) -> ``metrics`` (tables) -> ``scaling``
(strong/weak, Amdahl/Gustafson) -> ``report``.
"""
