"""Sharding schemes: how a backend holds its model states across the data-parallel ranks, one class per scheme.

A scheme owns everything in the planner that depends on it: the state bytes of one GPU (parameters, gradients,
optimizer states, and its own working terms and buffers: ``memory.stage_memory``), its data-parallel traffic per
step (``steptime.estimate_step_time``), the lines that say what those terms assume (``memory_notes``,
``time_notes``), the knobs the search turns (``search.enumerate_knobs``), the single changes ``validate`` suggests
(``fit``), and how a configuration names its knobs (``Knobs.describe``) and writes them back to the backend's options
section (``Knobs.overrides``). Each scheme's own knobs are a small type of its own (``Scheme.knobs``: ``MegatronKnobs``,
``ZeroKnobs``, ``FsdpKnobs``, ``HorovodKnobs``) with only the options it reads, named once there: built from the
recipe's options section by name, turned by the search, written back by name (``SchemeKnobs``); a configuration
(``Knobs.sharding``) holds one.

    distributed_optimizer   Megatron-core: fp32 main grads reduced (or reduce-scattered) over DP x CP, the
                            optimizer states sharded when the distributed optimizer is on
    zero                    DeepSpeed ZeRO stages 0-3 with optional CPU offload (Rajbhandari et al. 2019)
    fsdp                    PyTorch FSDP2: full_shard, HSDP (hybrid_shard) or DDP
    horovod                 Horovod's DistributedOptimizer: DDP's memory, ring all-reduce of (compressed) gradients

Which backend uses which scheme is written once, in the backend table (``hpc_tools.backends.Backend.sharding``); the
planner looks the scheme up by that name (``Knobs.scheme``), so a new backend with an existing scheme is a new row
there and touches no planner file. Formulas and sources: docs/formulas.md.

Modules: ``base`` (``Scheme``, what the planner asks; ``SchemeKnobs``, a scheme's own knobs; ``Knobs``, what a scheme
reads of a configuration), one per scheme: ``megatron``
(distributed_optimizer), ``zero``, ``fsdp``, ``horovod``; this package holds the table (``SCHEMES``, ``of``).
"""


from __future__ import annotations

from hpc_tools import backends
from hpc_tools.planner.sharding.base import Change, Knobs, Scheme, SchemeKnobs, setting
from hpc_tools.planner.sharding.fsdp import (
    UNSHARDED,
    Fsdp,
    FsdpKnobs,
    fsdp_state_bytes,
    fsdp_unsharded_bytes,
    shard_group,
)
from hpc_tools.planner.sharding.horovod import HVD_COPIES, Horovod, HorovodKnobs
from hpc_tools.planner.sharding.megatron import DistributedOptimizer, MegatronKnobs, megatron_state_bytes
from hpc_tools.planner.sharding.zero import (
    CPU_ADAM_PARAMS_PER_S,
    DS_DEFAULT_BUCKET_ELEMS,
    GATHERED,
    Zero,
    ZeroKnobs,
    zero_state_bytes,
)

__all__ = ["CPU_ADAM_PARAMS_PER_S", "DS_DEFAULT_BUCKET_ELEMS", "GATHERED", "HVD_COPIES", "UNSHARDED", "Change",
           "DistributedOptimizer", "Fsdp", "FsdpKnobs", "Horovod", "HorovodKnobs", "Knobs", "MegatronKnobs", "SCHEMES",
           "Scheme", "SchemeKnobs", "Zero", "ZeroKnobs", "dimensions", "fsdp_state_bytes", "fsdp_unsharded_bytes",
           "megatron_state_bytes", "of", "setting", "shard_group", "zero_state_bytes"]

SCHEMES: dict[str, Scheme] = {s.name: s for s in (DistributedOptimizer(), Zero(), Fsdp(), Horovod())}
# backend kind -> its scheme, for the kinds that train a model (asked per scored candidate: one dict lookup)
_BY_KIND: dict[str, Scheme] = {b.kind: SCHEMES[b.sharding] for b in backends.BACKENDS.values() if b.sharding}


def of(kind: str) -> Scheme:
    """The sharding scheme of backend ``kind`` (its row's ``sharding``)."""
    return _BY_KIND[kind]


def dimensions() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Each scheme's search dimension, labelled with the backend kinds that use it: ``ZeRO stage ... (deepspeed)``,
    its knobs named as ``Knobs`` attributes (``sharding.zero_stage``)."""
    return tuple((f"{s.dimension[0]} ({', '.join(b.kind for b in backends.BACKENDS.values() if b.sharding == name)})",
                  tuple(f"sharding.{a}" for a in s.dimension[1]))
                 for name, s in SCHEMES.items() if s.dimension[1])  # Horovod turns nothing
