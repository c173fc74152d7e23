"""Which layout changes a Megatron checkpoint's optimizer state survives: the one answer for the loader (on the
ranks), ``validate``/``submit`` (a ``checkpoint.load_path`` saved under another layout) and the elastic planner (the
layouts a run may continue in on fewer nodes).

A checkpoint's meta records the layout it was saved under (``hpc_tools.train.megatron.checkpoint.layout_meta``):
the parallel sizes, whether the distributed optimizer was on, and the precision. The model's weights load under any
layout (their keys are layout-independent); the optimizer state comes along when:

- the optimizer kind and the precision are the same (the distributed optimizer's state is sharded as its buffers
  are; a 16-bit run keeps fp32 master weights that a 32-bit one has not);
- with experts, expert parallelism stays on or off: Megatron-core chains a dense and an expert optimizer when
  expert_size > 1 (expert weights are then not all-reduced), and one optimizer otherwise, so the state's keys change
  (``chained_0.optimizer.state...`` against ``optimizer.state...``: a raw ``KeyError`` from dist_checkpointing);
- with the distributed optimizer, only the data-parallel size changes: its ``dp_reshardable`` shards follow the
  gradient buffers, whose contents change with the tensor, pipeline (virtual, uneven stages), context and expert
  sizes; its ``fully_reshardable`` format saves but does not load on megatron-core 0.16.1 (``KeyError: 'step'``).
"""

from __future__ import annotations

from typing import Any

MEGATRON_FORMAT = "megatron-dist-torch_dist"  # the meta's ``format`` of a Megatron checkpoint
DEFAULT_SIZES = {"context_size": 1, "expert_size": 1, "expert_tensor_size": 1, "first_stage_layers": None,
                 "last_stage_layers": None}
"""The sizes a checkpoint written before they were recorded was saved under (uneven stages: None, equal ones)."""
MODEL_PARALLEL = ("tensor_size", "pipeline_size", "virtual_pipeline_size", *DEFAULT_SIZES)


def size(meta: dict[str, Any], key: str):
    """A layout size of a checkpoint's meta; one it does not record is the default it was saved under."""
    return meta.get(key, DEFAULT_SIZES.get(key))


def _normal(key: str, value):
    """A virtual pipeline of None is one chunk per stage; the other sizes compare as recorded (uneven stages: None
    means equal stages)."""
    return (value or 1) if key == "virtual_pipeline_size" else value


def why_not(saved: dict[str, Any], here: dict[str, Any]) -> str | None:
    """Why optimizer state saved under layout ``saved`` cannot be loaded under ``here`` (None: it can)."""
    if saved["distributed_optimizer"] != here["distributed_optimizer"]:
        return (f"the optimizer changes (distributed_optimizer {str(saved['distributed_optimizer']).lower()} -> "
                f"{str(here['distributed_optimizer']).lower()})")
    if saved["precision"] != here["precision"]:
        return f"the precision changes ({saved['precision']} -> {here['precision']})"
    if (size(saved, "expert_size") > 1) != (size(here, "expert_size") > 1):
        return (f"expert parallelism turns {'off' if size(saved, 'expert_size') > 1 else 'on'} (expert_size "
                f"{size(saved, 'expert_size')} -> {size(here, 'expert_size')}: Megatron-core chains a separate expert "
                "optimizer only with expert_size > 1)")
    if here["distributed_optimizer"]:
        changed = [k for k in MODEL_PARALLEL if _normal(k, size(saved, k)) != _normal(k, size(here, k))]
        if changed:
            return ("the distributed optimizer's state reshards across a change of the data-parallel size only, and "
                    + ", ".join(f"{k} changes ({size(saved, k)} -> {size(here, k)})" for k in changed))
    return None


def optimizer_reshardable(saved: dict[str, Any], here: dict[str, Any]) -> bool:
    """Whether optimizer state saved under layout ``saved`` can be loaded under ``here``."""
    return why_not(saved, here) is None


def layout_sizes(layout, distributed_optimizer: bool, precision: str) -> dict[str, Any]:
    """The part of a checkpoint's layout meta ``why_not`` reads, for a ``hpc_tools.layout.ParallelLayout``."""
    return {"tensor_size": layout.tensor_size, "pipeline_size": layout.pipeline_size,
            "virtual_pipeline_size": layout.virtual_pipeline_size if layout.interleaved else None,
            "data_size": layout.data_size, "distributed_optimizer": distributed_optimizer,
            "context_size": layout.context_size, "expert_size": layout.expert_size,
            "expert_tensor_size": layout.expert_tensor_size, "first_stage_layers": layout.first_stage_layers,
            "last_stage_layers": layout.last_stage_layers, "precision": precision}
