"""Post-run analysis: per-run and per-rank metrics from step records, sweep tables, scaling fits, reports.

Pipeline: ``inputs`` (what to analyse: run / sweep folders) -> ``records`` (a run's records streamed rank file by
rank file and reduced by ``profiling.figures``, which defines every figure, never the whole trace) -> ``metrics``
(per-run, per-rank and per-step tables) -> ``scaling`` (strong/weak, Amdahl/Gustafson) -> ``report`` (report.md,
report.html, ``plots``). ``analyze`` is the one call from folders to every table; ``labels`` tells the runs apart;
``live`` is a running job's straggler verdict and goodput for ``status``; ``eval_tables`` and ``evaluation`` are the
scores ``eval`` and the sizes ``quantize`` wrote, as tables and as the report's section. The report opens with
``summary`` (what ran, its figures, the verdict), draws per-step plots with ``step_plots``, and its "Where the step
went" section is ``breakdown_report`` over ``breakdown`` (``analyze --breakdown``: traced steps against the plan)."""
