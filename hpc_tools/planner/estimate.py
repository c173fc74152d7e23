"""One plan: memory and step time of a recipe (or of a recipe with other knobs), with the assumptions behind them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hpc_tools import backends
from hpc_tools.errors import UserError
from hpc_tools.planner.arch import Arch, arch_for, total_parameters
from hpc_tools.planner.hardware import Hardware, hardware_for, headroom_bytes, headroom_note
from hpc_tools.planner.knobs import Knobs
from hpc_tools.planner.memory import MemoryPlan, estimate_memory, memory_notes
from hpc_tools.planner.steptime import DEFAULT_EFFICIENCY, StepTime, estimate_step_time, step_flops, time_notes
from hpc_tools.planner.unmodelled import memory_not_modelled
from profiling.flops import active_parameters

if TYPE_CHECKING:
    from hpc_tools.recipe.schema import Recipe


ACTIVE_NOTE = ("parameters_active: the parameters one token passes through (every dense part; in MoE layers the "
               "router, the top-k routed experts and the shared expert), counting the input embedding whole; "
               "equal to parameters for a dense model")


@dataclass(frozen=True, slots=True)
class Plan:
    name: str
    arch: Arch
    knobs: Knobs
    hardware: Hardware
    memory: MemoryPlan
    time: StepTime | None
    efficiency: float
    efficiency_source: str  # "default", "calibration <file>", "--efficiency"
    convention: str
    parameters: int  # whole model, TP1 padding
    parameters_active: int = 0  # what one token passes through (top-k experts), counting the input embedding
    parameters_active_without_input_embedding: int = 0
    headroom_bytes: float = 0.0  # GPU memory kept free (hardware.headroom_bytes)
    headroom_note: str = ""

    @property
    def usable_bytes(self) -> float | None:
        """The GPU memory less the headroom; None when there is no GPU memory to check."""
        return None if self.hardware.mem_bytes is None else self.hardware.mem_bytes - self.headroom_bytes

    @property
    def fits(self) -> bool | None:
        """True/False against the GPU memory less the headroom; None when there is no GPU memory to check (CPU
        ranks, unknown GPU)."""
        if self.hardware.mem_bytes is None:
            return None
        return self.memory.total <= self.usable_bytes

    def notes(self) -> dict[str, str]:
        out = memory_notes(self.arch, self.knobs, self.hardware.is_gpu)
        if self.time is not None:
            out.update(time_notes(self.knobs, self.hardware, self.efficiency, self.efficiency_source, self.convention))
        return out

    def held(self, stage_params: int) -> float:
        """The parameters one GPU holds of its stage's ``stage_params`` (those of its TP/PP/EP shard): divided by
        the shard group under FSDP full_shard/hybrid_shard and by the data-parallel size under ZeRO-3, which keep
        1/S of them on each rank (gathered for use: the memory terms' own lines)."""
        return self.knobs.scheme.held(self.knobs, stage_params)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready summary (bytes, seconds, FLOPs as plain numbers; GB = 1e9 bytes)."""
        mem = self.memory.peak
        notes = self.notes()
        out: dict[str, Any] = {
            "recipe": self.name, "config": self.knobs.describe(), "scheme": self.knobs.scheme.name,
            "layout": self.knobs.layout.describe(),
            "parameters": self.parameters, "parameters_active": self.parameters_active,
            "parameters_active_without_input_embedding": self.parameters_active_without_input_embedding,
            "parameters_active_counts": ACTIVE_NOTE, "parameters_per_gpu": self.held(mem.params),
            "gpu_type": self.hardware.gpu_type, "gpu_mem_bytes": self.hardware.mem_bytes,
            "hardware_sources": self.hardware.sources, "fits": self.fits,
            "headroom_bytes": self.headroom_bytes, "headroom": self.headroom_note, "usable_bytes": self.usable_bytes,
            "memory_not_modelled": memory_not_modelled(self.knobs),
            "memory": {"peak_stage": mem.stage, "total_bytes": mem.total,
                       "terms": [{"name": k, "bytes": v, "assumes": notes.get(k, "")} for k, v in mem.terms.items()],
                       "stages": [{"stage": s.stage, "parameters": self.held(s.params), "total_bytes": s.total}
                                  for s in self.memory.stages]},
            "step_time": None,
        }
        if self.time is not None:
            out["step_time"] = {
                "total_s": self.time.total_s, "tokens_per_s": self.time.tokens_per_s, "mfu": self.time.mfu,
                "mfu_peak": f"{self.knobs.precision} dense peak {self.time.peak_flops / 1e12:.0f} TFLOP/s",
                "mfu_fp8": self.time.mfu_fp8,
                "mfu_fp8_peak": (f"FP8 dense peak {self.time.peak_flops_fp8 / 1e12:.0f} TFLOP/s"
                                 if self.time.peak_flops_fp8 else None),
                "model_flops": self.time.model_flops, "hardware_flops": self.time.hardware_flops,
                "efficiency": self.efficiency, "efficiency_source": self.efficiency_source,
                "flops_convention": self.convention,
                "terms": [{"name": k, "seconds": v, "assumes": notes.get(k, "")} for k, v in self.time.terms.items()],
            }
        return out


def make_plan(recipe: "Recipe", knobs: Knobs | None = None, efficiency: float | None = None,
              efficiency_source: str = "default", hardware: Hardware | None = None) -> Plan:
    """Memory and step time of ``recipe`` (with ``knobs`` instead of the recipe's own, when given), checked against
    the GPU memory less the recipe's headroom."""
    if not backends.of(recipe).trains_model:
        raise UserError(f"backend.kind={recipe.backend.kind} trains no model, so there is nothing to plan "
                        f"(plan a recipe of backend.kind {' or '.join(backends.with_feature('trains_model'))})")
    knobs = knobs or Knobs.from_recipe(recipe)
    hw = hardware or hardware_for(recipe.cluster, recipe.training.precision, fp8=knobs.fp8 is not None)
    arch = arch_for(recipe)
    eff = DEFAULT_EFFICIENCY if efficiency is None else efficiency
    convention = recipe.profiling.flops_convention
    time = (estimate_step_time(arch, knobs, hw, step_flops(recipe.model, knobs, convention), eff)
            if hw.peak_flops else None)
    return Plan(name=recipe.name, arch=arch, knobs=knobs, hardware=hw, memory=estimate_memory(arch, knobs, hw.is_gpu),
                time=time, efficiency=eff, efficiency_source=efficiency_source, convention=convention,
                parameters=total_parameters(arch),
                parameters_active=active_parameters(recipe.model, vocab_size=arch.padded_vocab(1)),
                parameters_active_without_input_embedding=active_parameters(
                    recipe.model, vocab_size=arch.padded_vocab(1), input_embedding=False),
                headroom_bytes=headroom_bytes(recipe.cluster, hw.mem_bytes),
                headroom_note=headroom_note(recipe.cluster, hw.mem_bytes))
