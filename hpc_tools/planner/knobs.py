"""The choices one plan is made of: the parallel layout plus the memory/speed knobs the search turns.

``Knobs.from_recipe`` reads them from a recipe; ``Knobs.overrides`` writes them back as ``--set`` strings, so that a
search result can be applied with the same precedence as the command line. The backend's sharding options are not
fields here: ``Knobs.sharding`` holds its scheme's own knobs type (``hpc_tools.planner.sharding``), which names,
reads and writes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hpc_tools import backends
from hpc_tools.layout import ParallelLayout
from hpc_tools.planner import sharding
from hpc_tools.recipe.training import recompute_modules

if TYPE_CHECKING:
    from hpc_tools.recipe.schema import Recipe

# Fields of ``section_updates`` that ``overrides`` writes only where they mean something.
_ONLY_FULL_RECOMPUTE = frozenset({"recompute_method", "recompute_num_layers"})
_ONLY_EXPERTS = frozenset({"expert_size", "expert_tensor_size"})


@dataclass(frozen=True, slots=True)
class Knobs:
    backend: str  # a backend.kind that trains a model; its traits are its row of the backend table (``row``)
    layout: ParallelLayout
    precision: str
    recompute: str  # "none" | "selective" | "full"
    # the backend's sharding options: its scheme's own knobs type (``scheme.knobs``, e.g. ``ZeroKnobs``)
    sharding: sharding.SchemeKnobs
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    flash: bool = True  # fused attention: no s^2 activations stored
    # the attention path (backends.py attention_path: te | te-unfused | sdpa | unfused): efficiency and what the
    # attention core keeps for backward
    attention: str = "te"
    on_gpu: bool = True  # CUDA kernels (1-byte dropout masks, fused norms); False: the CPU build's kernels
    fp8: str | None = None  # training.fp8 (e4m3 | hybrid) where the backend runs it; None: 16-bit GEMMs
    dispatcher: str = "alltoall"  # model.moe_token_dispatcher_type
    moe: bool = False  # the model has experts (parallel.expert_tensor_size null means 1, else tensor_size)
    # training.recompute_modules as the recipe gives it (None: Megatron-core's default [core_attn]); read only with
    # selective recomputation (``recomputed``)
    recompute_modules: tuple[str, ...] | None = None
    ep_overlap: bool = False  # parallel.overlap_moe_expert_parallel_comm (Megatron's combined 1F1B)
    shared_expert_overlap: bool = False  # parallel.moe_shared_expert_overlap

    @classmethod
    def from_recipe(cls, recipe: "Recipe") -> "Knobs":
        t, be = recipe.training, recipe.backend
        row = backends.of(recipe)
        flash = row.flash_attention(recipe)
        return cls(backend=be.kind, layout=ParallelLayout.from_recipe(recipe), precision=t.precision,
                   recompute=t.recompute_granularity,
                   sharding=sharding.of(be.kind).knobs.from_recipe(recipe, row.options),
                   recompute_method=t.recompute_method, recompute_num_layers=t.recompute_num_layers,
                   flash=flash, attention=row.attention_path(recipe),
                   on_gpu=recipe.cluster.uses_gpus,
                   fp8=t.fp8 if row.fp8 else None, dispatcher=recipe.model.moe_token_dispatcher_type,
                   moe=recipe.model.num_experts is not None,
                   recompute_modules=tuple(t.recompute_modules) if t.recompute_modules is not None else None,
                   ep_overlap=row.moe_comm_overlap and recipe.parallel.overlap_moe_expert_parallel_comm,
                   shared_expert_overlap=row.moe_comm_overlap and recipe.parallel.moe_shared_expert_overlap)

    @property
    def row(self) -> backends.Backend:
        """The backend table's record of this configuration's backend."""
        return backends.backend(self.backend)

    @property
    def scheme(self) -> sharding.Scheme:
        """How the backend shards the model states (its row's ``sharding``): the memory terms, data-parallel
        traffic, notes and search knobs that depend on it."""
        return sharding.of(self.backend)

    @property
    def recomputed(self) -> frozenset[str]:
        """The layer parts selective recomputation recomputes (Megatron-core's module names); empty otherwise."""
        return frozenset(recompute_modules(self.recompute, self.recompute_modules))

    @property
    def virtual(self) -> int:
        return self.layout.virtual_pipeline_size if self.layout.interleaved else 1

    @property
    def act_bytes(self) -> int:
        """Bytes per activation element (16-bit training stores 16-bit activations)."""
        return 4 if self.precision == "fp32" else 2

    def describe(self) -> str:
        """Short label naming every dimension the search turns, each always (also at its default), e.g.
        ``TP2 PP4 VPP2 CP1 DP8 SP EP8xETP1 mb2 rc=selective distopt`` (EPxETP for models with experts)."""
        lay = self.layout
        pp = f"PP{lay.pipeline_size}"
        if lay.uneven:  # PP16[2|..|3]: the first and/or last stage's own layer count, the others split the rest
            first, last = lay.first_stage_layers, lay.last_stage_layers
            pp += "[" + "|".join([*([str(first)] if first is not None else []), "..",
                                  *([str(last)] if last is not None else [])]) + "]"
        parts = [f"TP{lay.tensor_size}", pp, f"VPP{self.virtual}", f"CP{lay.context_size}",
                 f"DP{lay.data_size}", "SP" if lay.sequence_parallel else "no-SP"]
        if self.moe:
            parts.append(f"EP{lay.expert_size}xETP{lay.expert_tensor_size}")
        parts.append(f"mb{lay.micro_batch_size}")
        parts.append(f"rc={self.recompute}" + (f"({self.recompute_method},{self.recompute_num_layers})"
                                                if self.recompute == "full" else ""))
        if self.recompute == "selective" and self.recompute_modules is not None:
            parts[-1] += "(" + ",".join(self.recompute_modules) + ")"
        if self.ep_overlap or self.shared_expert_overlap:
            parts.append("a2a-overlap" if self.ep_overlap else "shared-expert-overlap")
        if self.fp8:
            parts.append(f"fp8-{self.fp8}")
        parts += self.scheme.describe(self)
        return " ".join(parts)

    def overrides(self) -> list[str]:
        """``--set`` strings that turn a recipe into this configuration: every field ``section_updates`` writes
        (global batch pinned explicitly), each always, also where it equals the default or the recipe's value, so
        that applying them re-plans to this configuration whatever the recipe held. Left out: the full-recompute
        method and layer count unless the recompute is full, and the expert sizes of a model without experts (the
        rules hold them at 1 / null there)."""
        out = []
        for section, fields in self.section_updates().items():
            prefix = section if section in ("parallel", "training") else f"backend.{section}"
            for key, value in fields.items():
                if key in _ONLY_FULL_RECOMPUTE and self.recompute != "full":
                    continue
                if key in _ONLY_EXPERTS and not self.moe:
                    continue
                out.append(f"{prefix}.{key}={sharding.setting(value)}")
        return out

    def section_updates(self) -> dict[str, dict[str, Any]]:
        """The same changes as nested field updates per recipe section (for model_copy). Every field written here is
        also a ``--set`` of ``overrides`` (a dimension the search turns belongs here, or its rows cannot be applied)."""
        lay = self.layout
        upd: dict[str, dict[str, Any]] = {
            "parallel": {"tensor_size": lay.tensor_size, "pipeline_size": lay.pipeline_size,
                         "virtual_pipeline_size": lay.virtual_pipeline_size if lay.interleaved else None,
                         "data_size": -1, "sequence_parallel": lay.sequence_parallel,
                         "context_size": lay.context_size, "expert_size": lay.expert_size,
                         "expert_tensor_size": lay.expert_tensor_size if self.moe else None,
                         "num_layers_in_first_pipeline_stage": lay.first_stage_layers,
                         "num_layers_in_last_pipeline_stage": lay.last_stage_layers},
            "training": {"micro_batch_size": lay.micro_batch_size, "global_batch_size": lay.global_batch_size,
                         "recompute_granularity": self.recompute, "recompute_method": self.recompute_method,
                         "recompute_num_layers": self.recompute_num_layers},
        }
        if self.recompute_modules is not None:  # the recipe's list, kept where it is read (selective) only
            upd["training"]["recompute_modules"] = (list(self.recompute_modules) if self.recompute == "selective"
                                                    else None)
        upd[self.row.options] = self.sharding.option_updates()  # the sharding knobs, in the backend's section
        return upd


def apply_knobs(recipe: "Recipe", k: Knobs) -> "Recipe":
    """A copy of ``recipe`` with the knobs written into its sections (not re-validated: the values are typed)."""
    upd = k.section_updates()
    backend = recipe.backend
    kind = backends.backend(k.backend).options
    backend = backend.model_copy(update={kind: getattr(backend, kind).model_copy(update=upd[kind])})
    return recipe.model_copy(update={"parallel": recipe.parallel.model_copy(update=upd["parallel"]),
                                     "training": recipe.training.model_copy(update=upd["training"]),
                                     "backend": backend})
