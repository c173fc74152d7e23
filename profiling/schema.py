"""The per-rank step record: the one definition every trainer writes and every analysis reads.

Versioned: a change that renames or retypes a field bumps SCHEMA_VERSION, and so does a new field a reader may look
for (version 2 added ``val_loss`` and ``eval_time_s``; version 3 ``cpu_time_s``, ``involuntary_switches`` and
``collective_wait_s``, what tells a rank the host stalled from one slow in its own code; version 4 the router figures
of mixture-of-experts runs, ``moe_aux_loss``, ``moe_load_imbalance`` and ``moe_tokens_per_expert``; version 5
``host_stall_s``, a rank's own evidence that the host stopped or descheduled it); readers accept every version up to
SCHEMA_VERSION: an older file simply lacks the newer columns (``profiling.records`` reads them as
absent).
Records are appended as JSON lines to ``records/rank<RANK>.jsonl`` during the run (a requeued job appends to the same
file) and compacted into ``records/rank<RANK>.parquet`` at the end (``profiling.records`` owns the file names and the
reading). Optional fields are null when not measured on that step or rank (e.g. ``loss`` off the last pipeline stage,
communication on unsampled steps, GPU fields on CPU). What the figures made from them mean: ``profiling.figures``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SCHEMA_VERSION = 5
READABLE_VERSIONS = (1, 2, 3, 4)
"""Record versions every reader accepts."""


@dataclass(frozen=True, slots=True)
class Field:
    name: str
    type: str  # "int", "float", "str", "bool"
    required: bool
    doc: str


STEP_FIELDS: tuple[Field, ...] = (
    Field("schema_version", "int", True, "SCHEMA_VERSION of the writer"),
    Field("run_id", "str", True, "run folder name"),
    Field("job_id", "str", False, "Slurm job id (null when local)"),
    Field("restart", "int", True, "0 for the first start, +1 per requeue (SLURM_RESTART_COUNT) or `resume`"),
    Field("rank", "int", True, "global rank"),
    Field("node", "str", True, "hostname"),
    Field("tp_rank", "int", True, "tensor-parallel rank"),
    Field("pp_rank", "int", True, "pipeline stage"),
    Field("dp_rank", "int", True, "data-parallel rank"),
    Field("step", "int", True, "optimizer step, 1-based, continues across resumes"),
    Field("time", "float", True, "unix time at the end of the step"),
    Field("step_time_s", "float", True, "wall time of the step on this rank (GPU: event-timed, see profiling docs)"),
    Field("data_time_s", "float", False, "time spent producing this step's batches"),
    Field("tokens", "int", True, "tokens consumed by the whole job in this step (global batch x sequence length)"),
    Field("tokens_per_s", "float", True, "tokens / step_time_s for the whole job"),
    Field("tokens_per_s_per_gpu", "float", True, "tokens_per_s / world size"),
    Field("loss", "float", False, "mean training loss of the step (ranks that know it; Megatron broadcasts it to all)"),
    Field("lr", "float", False, "learning rate used in the step"),
    Field("grad_norm", "float", False, "global gradient norm before clipping"),
    Field("model_flops", "float", False, "model FLOPs of the whole step, under flops_convention"),
    Field("hardware_flops", "float", False, "FLOPs executed in the step counting recomputation (for hfu)"),
    Field("tflops_per_gpu", "float", False, "model TFLOP/s per GPU"),
    Field("mfu", "float", False, "model FLOPs utilisation (0-1); null when the peak is unknown"),
    Field("hfu", "float", False, "hardware FLOPs utilisation counting recomputation (0-1)"),
    Field("mem_allocated_max_bytes", "int", False, "torch.cuda.max_memory_allocated over the step"),
    Field("mem_reserved_max_bytes", "int", False, "torch.cuda.max_memory_reserved over the step"),
    Field("rss_bytes", "int", False, "resident set size of the rank process"),
    Field("comm_time_s", "float", False, "time in collectives during the step (sampled steps only)"),
    Field("comm_bytes", "int", False, "bytes moved by collectives during the step (sampled steps only)"),
    Field("pp_wait_s", "float", False, "time waiting on pipeline p2p during the step (measured bubble)"),
    Field("bubble_fraction", "float", False, "pp_wait_s / step_time_s"),
    Field("skipped", "bool", False, "the optimizer skipped this step (fp16 overflow, or a non-finite step)"),
    Field("val_loss", "float", False, "mean validation loss over training.eval_iters validation batches, the same on "
                                      "every rank; null except at evaluation steps (schema version 2)"),
    Field("eval_time_s", "float", False, "wall seconds the evaluation after this step took (not part of step_time_s); "
                                         "null except at evaluation steps (schema version 2)"),
    Field("nonfinite", "bool", False, "the step's loss or gradient norm was not finite on some rank: the update was "
                                      "skipped (training.max_nonfinite_steps)"),
    Field("cpu_time_s", "float", False, "CPU seconds (user + system, all threads of the rank process) over the step, "
                                        "from getrusage (schema version 3)"),
    Field("involuntary_switches", "int", False, "involuntary context switches of the rank process during the step "
                                                "(getrusage ru_nivcsw: the OS took the CPU from it; schema version 3)"),
    Field("collective_wait_s", "float", False, "host seconds this rank was held in collectives other than pipeline "
                                               "p2p during the step, every step (a rank that arrives late waits "
                                               "least); null on GPU ranks and without profiling.communication "
                                               "(schema version 3)"),
    Field("moe_aux_loss", "float", False, "mixture of experts: the router's load-balancing loss (without its "
                                          "coefficient), mean over the MoE layers and microbatches, the same on every "
                                          "rank; null without experts or with load_balancing_type none (schema "
                                          "version 4)"),
    Field("moe_load_imbalance", "float", False, "mixture of experts: max over the MoE layers of the busiest expert's "
                                                "tokens / the mean tokens per expert in the step (1 = even), the same "
                                                "on every rank (schema version 4)"),
    Field("moe_tokens_per_expert", "str", False, "mixture of experts: tokens routed to each expert in the step "
                                                 "(a token counts once per top-k expert), summed over the MoE layers, "
                                                 "as a JSON list (schema version 4)"),
    Field("host_stall_s", "float", False, "seconds the host kept the rank process from running during the step "
                                          "(stopped or descheduled: its wake-ups more than 20 ms late, "
                                          "profiling/stall.py); schema version 5"),
)

FIELD_NAMES = tuple(f.name for f in STEP_FIELDS)
REQUIRED = tuple(f.name for f in STEP_FIELDS if f.required)
_PY_TYPES = {"int": int, "float": (int, float), "str": str, "bool": bool}


def fields(*names: str) -> tuple[str, ...]:
    """``names`` checked against the schema: a reader's column list that names a field the writer never writes would
    silently read nothing, so a typo fails at import instead."""
    unknown = [n for n in names if n not in FIELD_NAMES]
    if unknown:
        raise ValueError(f"{unknown} are not step record fields (profiling.schema.STEP_FIELDS)")
    return tuple(names)


def validate_record(record: dict[str, Any]) -> None:
    """Raise ValueError naming the first field that breaks the schema."""
    unknown = set(record) - set(FIELD_NAMES) - set(record.get("extra", {}) and ["extra"])
    if unknown:
        raise ValueError(f"step record has unknown fields {sorted(unknown)}; add them to profiling.schema.STEP_FIELDS")
    for f in STEP_FIELDS:
        value = record.get(f.name)
        if value is None:
            if f.required:
                raise ValueError(f"step record is missing required field {f.name!r} ({f.doc})")
            continue
        if not isinstance(value, _PY_TYPES[f.type]) or (f.type != "bool" and isinstance(value, bool)):
            raise ValueError(f"step record field {f.name!r}={value!r} must be {f.type}")


def arrow_schema():
    """The schema as a pyarrow schema (for the compacted parquet files)."""
    import pyarrow as pa

    types = {"int": pa.int64(), "float": pa.float64(), "str": pa.string(), "bool": pa.bool_()}
    return pa.schema([pa.field(f.name, types[f.type], nullable=not f.required) for f in STEP_FIELDS])
