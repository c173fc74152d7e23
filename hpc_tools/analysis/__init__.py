"""Post-run analysis: per-run and per-rank metrics from step records, sweep tables, scaling fits, reports.

Pipeline: ``inputs.discover`` (run / sweep folders) -> ``records.read_run`` (per-rank aggregation while reading, never
the whole trace) -> ``metrics.run_metrics`` -> ``scaling`` (strong/weak, Amdahl/Gustafson) -> ``report``.
"""
