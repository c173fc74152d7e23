"""The dimensions the layout search turns (``hpc_tools.planner.search.enumerate_knobs``), named once for its users:
``plan --help`` lists them, and a unit test (tests/unit/test_cli_help.py) enumerates the search on several recipes and
checks that the ``Knobs`` attributes it varies are exactly the ones named here, so a dimension added to the search and
not here (or named here and not turned) fails the suite.

Each entry: the label users read, and the ``Knobs`` attributes (``layout.X`` for the ParallelLayout's, ``sharding.X``
for the scheme's own knobs) it turns; a sharding scheme's entry is its own (``hpc_tools.planner.sharding``).
"""

from __future__ import annotations

from hpc_tools.planner import sharding

DIMENSIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("TP", ("layout.tensor_size",)),
    ("PP", ("layout.pipeline_size",)),
    ("uneven first/last pipeline stages", ("layout.first_stage_layers", "layout.last_stage_layers")),
    ("VPP", ("layout.virtual_pipeline_size",)),
    ("CP", ("layout.context_size",)),
    ("EP", ("layout.expert_size",)),
    ("ETP", ("layout.expert_tensor_size",)),
    ("DP", ("layout.data_size",)),
    ("sequence parallelism (on wherever TP > 1 allows it)", ("layout.sequence_parallel",)),
    ("micro batch", ("layout.micro_batch_size",)),
    ("recompute (none, selective, full)", ("recompute",)),
    # each sharding scheme's knobs, labelled with the backend kinds that use it: "distributed optimizer (megatron)"
    *sharding.dimensions(),
)


def searched_text() -> str:
    """The dimensions as one phrase for --help: ``TP, PP, VPP, ..., FSDP strategy ...``."""
    labels = [label for label, _ in DIMENSIONS]
    return ", ".join(labels)
