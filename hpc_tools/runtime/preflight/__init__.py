"""Preflight: the allocation checked on every rank before step 1 (``cluster.preflight``; docs/preflight.md).

- ``verdict``: the thresholds, the bus-bandwidth formulas, the transport parsers and the per-node table (no torch);
- ``bisect``: the search for a slow node in at most ceil(log2 N) + 1 collective rounds (no torch);
- ``measure``: the rank-side measurements (GEMM, memory bandwidth, collectives; imports torch);
- ``run``: the checks on the ranks, the table in the run folder and the decision (``strict`` / ``auto``);
- ``links``: the collectives over groups of ranks: agreed times, groups timed at once or in turn, the slow-link
  search's rounds (imports torch where it runs them);
- ``leave_out``: how a named node is left out, shared with the restart controller (the hints, the marker, exit 85).
"""
