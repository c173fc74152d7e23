"""Sharding schemes: how a backend holds its model states across the data-parallel ranks, one class per scheme.

A scheme owns everything in the planner that depends on it: the state bytes of one GPU (parameters, gradients,
optimizer states, and its own working terms and buffers: ``memory.stage_memory``), its data-parallel traffic per
step (``steptime.estimate_step_time``), the lines that say what those terms assume (``memory_notes``,
``time_notes``), the knobs the search turns (``search.enumerate_knobs``), the single changes ``validate`` suggests
(``fit``), and how a configuration names its knobs (``Knobs.describe``) and writes them back to the backend's options
section (``Knobs.overrides``).

    distributed_optimizer   Megatron-core: fp32 main grads reduced (or reduce-scattered) over DP x CP, the
                            optimizer states sharded when the distributed optimizer is on
    zero                    DeepSpeed ZeRO stages 0-3 with optional CPU offload (Rajbhandari et al. 2019)
    fsdp                    PyTorch FSDP2: full_shard, HSDP (hybrid_shard) or DDP
    horovod                 Horovod's DistributedOptimizer: DDP's memory, ring all-reduce of (compressed) gradients

Which backend uses which scheme is written once, in the backend table (``hpc_tools.backends.Backend.sharding``); the
planner looks the scheme up by that name (``Knobs.scheme``), so a new backend with an existing scheme is a new row
there and touches no planner file. Formulas and sources: docs/formulas.md.

Modules: ``base`` (``Scheme``, what the planner asks; ``Knobs``, what a scheme reads), one per scheme: ``megatron``
(distributed_optimizer), ``zero``, ``fsdp``, ``horovod``; this package holds the table (``SCHEMES``, ``of``).
"""


from __future__ import annotations

from hpc_tools import backends
from hpc_tools.planner.sharding.base import Change, Knobs, Scheme
from hpc_tools.planner.sharding.fsdp import UNSHARDED, Fsdp, fsdp_state_bytes, fsdp_unsharded_bytes
from hpc_tools.planner.sharding.horovod import HVD_COPIES, Horovod
from hpc_tools.planner.sharding.megatron import DistributedOptimizer, megatron_state_bytes
from hpc_tools.planner.sharding.zero import CPU_ADAM_PARAMS_PER_S, GATHERED, Zero, zero_state_bytes

__all__ = ["CPU_ADAM_PARAMS_PER_S", "GATHERED", "HVD_COPIES", "UNSHARDED", "Change", "DistributedOptimizer", "Fsdp",
           "Horovod", "Knobs", "SCHEMES", "Scheme", "Zero", "dimensions", "fsdp_state_bytes", "fsdp_unsharded_bytes",
           "megatron_state_bytes", "of", "zero_state_bytes"]

SCHEMES: dict[str, Scheme] = {s.name: s for s in (DistributedOptimizer(), Zero(), Fsdp(), Horovod())}
# backend kind -> its scheme, for the kinds that train a model (asked per scored candidate: one dict lookup)
_BY_KIND: dict[str, Scheme] = {b.kind: SCHEMES[b.sharding] for b in backends.BACKENDS.values() if b.sharding}


def of(kind: str) -> Scheme:
    """The sharding scheme of backend ``kind`` (its row's ``sharding``)."""
    return _BY_KIND[kind]


def dimensions() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Each scheme's search dimension, labelled with the backend kinds that use it: ``ZeRO stage ... (deepspeed)``."""
    return tuple((f"{s.dimension[0]} ({', '.join(b.kind for b in backends.BACKENDS.values() if b.sharding == name)})",
                  s.dimension[1]) for name, s in SCHEMES.items() if s.dimension[1])  # Horovod turns nothing
