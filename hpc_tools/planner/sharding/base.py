"""What the planner asks a sharding scheme (``Scheme``), the base of each scheme's own knobs type (``SchemeKnobs``),
what a scheme reads of a configuration (``Knobs``), and the helpers every scheme shares (``change``: one knob change
with its ``--set`` strings; ``setting``: a value as ``--set`` spells it)."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import TYPE_CHECKING, Any, ClassVar, Iterator, Protocol

from hpc_tools.planner.arch import (
    Arch,
    busiest_moe_stage,
    stage_split,
)

if TYPE_CHECKING:
    from hpc_tools.layout import ParallelLayout
    from hpc_tools.planner.hardware import Hardware
    from hpc_tools.recipe.schema import Recipe


class SchemeKnobs:
    """A scheme's own knobs (each scheme's subclass: a frozen dataclass with only its options), the one place they
    are named. A field named like a field of the backend's options section (``backend.<options>``) is read from it
    by name (``from_recipe``) and written back to it by name (``option_updates``), unless its metadata says ``kept``
    (the search never turns it: the recipe's value stays); a field whose metadata names a ``source`` is derived from
    the recipe another way (DeepSpeed's zero_optimization keys) and never written. ``elsewhere``: the section's other
    options, each with where the planner reads it instead (or why it does not), so that every option of the section
    is decided (tests/unit/test_scheme_knobs.py)."""

    __slots__ = ()
    elsewhere: ClassVar[dict[str, str]] = {}

    @classmethod
    def from_recipe(cls, recipe: "Recipe", options: str) -> "SchemeKnobs":
        """The knobs as ``recipe``'s options section ``backend.<options>`` gives them (``derived``: the others)."""
        section = getattr(recipe.backend, options)
        return cls(**{name: getattr(section, name) for name in cls.options()}, **cls.derived(recipe))

    @classmethod
    def derived(cls, recipe: "Recipe") -> dict[str, Any]:
        """The values of the fields that are not options of the backend's section (their ``source`` metadata)."""
        return {}

    @classmethod
    def options(cls) -> tuple[str, ...]:
        """The fields that are options of the backend's section, read from it."""
        return tuple(f.name for f in fields(cls) if "source" not in f.metadata)

    @classmethod
    def written(cls) -> tuple[str, ...]:
        """The options written back to the section (``--set`` strings, ``apply_knobs``)."""
        return tuple(f.name for f in fields(cls) if "source" not in f.metadata and "kept" not in f.metadata)

    def option_updates(self) -> dict[str, Any]:
        """The knobs as fields of the backend's own options section."""
        return {name: getattr(self, name) for name in self.written()}


class Knobs(Protocol):
    """What a scheme reads of a configuration: ``hpc_tools.planner.knobs.Knobs`` (not imported: that module looks its
    scheme up here), the layout and precision every scheme reads, then the scheme's own knobs (``sharding``, of its
    ``Scheme.knobs`` type)."""
    layout: "ParallelLayout"
    precision: str
    moe: bool
    sharding: Any  # the scheme's SchemeKnobs subclass

    @property
    def virtual(self) -> int: ...


Change = tuple[list[str], Knobs]  # ``--set`` strings and the configuration they make (``fit``)


class Scheme:
    """What the planner asks a sharding scheme. ``k`` is the configuration (``Knobs``) being planned."""

    name: ClassVar[str]
    """The backend table's ``sharding`` value."""
    knobs: ClassVar[type[SchemeKnobs]]
    """Its own knobs' type (``Knobs.sharding`` holds one): only the options it reads."""
    dimension: ClassVar[tuple[str, tuple[str, ...]]]
    """What the search turns for it: the label users read and the fields of its ``knobs`` (``planner/dimensions.py``
    names them ``sharding.<field>``)."""

    # --- memory -----------------------------------------------------------------------------------------------------
    def states(self, arch: Arch, k: Knobs, stage: int) -> tuple[int, float, float, float]:
        """(parameters of the stage one GPU computes with, parameter, gradient, optimizer bytes on one GPU)."""
        raise NotImplementedError

    def working_terms(self, arch: Arch, k: Knobs) -> dict[str, float]:
        """Memory terms of its own (gathered or unsharded copies), after the activations."""
        return {}

    def bucket_bytes(self, k: Knobs, n_params: int) -> float:
        """Communication buffers beyond NCCL's own."""
        return 0.0

    def held(self, k: Knobs, stage_params: int) -> float:
        """The parameters one GPU keeps of the ``stage_params`` it computes with (sharded schemes: a 1/S share)."""
        return stage_params

    def state_notes(self, arch: Arch, k: Knobs) -> tuple[str, str, str]:
        """What the parameter, gradient and optimizer terms assume."""
        raise NotImplementedError

    def working_notes(self, arch: Arch, k: Knobs) -> dict[str, str]:
        """What ``working_terms`` assume, by term."""
        return {}

    def bucket_note(self, k: Knobs) -> str:
        """Appended to the communication-buffer line."""
        return ""

    def moments_on_gpu(self, k: Knobs) -> bool:
        """The fp32 optimizer moments live in GPU memory (so storing them in BF16 would save some)."""
        return True

    # --- step time --------------------------------------------------------------------------------------------------
    def dp_time(self, arch: Arch, k: Knobs, hw: "Hardware", compute: float) -> tuple[float, float]:
        """(exposed data-parallel communication, offload) seconds per step; ``compute``: the step's compute."""
        raise NotImplementedError

    def dp_note(self, k: Knobs) -> str:
        """The data-parallel line up to its bandwidth (``... at ``)."""
        raise NotImplementedError

    def offload_note(self, k: Knobs, hw: "Hardware") -> str:
        return "no offload"

    # --- knobs ------------------------------------------------------------------------------------------------------
    def options(self, base: Knobs, t: int, p: int, d: int, overlap: bool | None) -> Iterator[SchemeKnobs]:
        """The knobs (of its ``knobs`` type) the search tries on a TP ``t`` x PP ``p`` x DP ``d`` layout, each from
        ``base.sharding`` (``overlap``: the recipe's DeepSpeed overlap_comm, None where it sets none)."""
        raise NotImplementedError

    def describe(self, k: Knobs) -> list[str]:
        """Its part of ``Knobs.describe``."""
        raise NotImplementedError

    def cheap_changes(self, k: Knobs, options: str) -> Iterator[Change]:
        """Single changes that cost (almost) no step time, tried before any relayout (``options``: the backend's
        options section, ``backend.<name>``)."""
        return iter(())

    def changes(self, k: Knobs, options: str) -> Iterator[Change]:
        """Single changes of its knobs, tried after the relayouts and before a deeper pipeline."""
        return iter(())

    # --- elastic layouts (``hpc_tools.planner.elastic``) -------------------------------------------------------------
    def carries(self, base: Knobs, cand: Knobs) -> bool:
        """Whether a checkpoint saved under ``base`` resumes, optimizer state included, into ``cand`` (a scheme
        whose checkpoints hold each data-parallel rank's partition: never at another layout)."""
        return False

    def carry_fix(self, k: Knobs) -> str:
        """A change of its knobs that would let more layouts carry the checkpoint (``, or <field>: <value> (why)``),
        for the refusal of a ``cluster.min_nodes`` with none; "" where there is none."""
        return ""


def change(k: Knobs, options: str, **knobs: Any) -> Change:
    """One single change of a scheme's knobs (``fit``): the configuration with ``knobs`` replaced and the ``--set``
    strings of those of them that are options of the backend's section (``options``: ``backend.<name>``), in the
    order given."""
    written = type(k.sharding).written()
    sets = [f"{options}.{name}={setting(value)}" for name, value in knobs.items() if name in written]
    return sets, replace(k, sharding=replace(k.sharding, **knobs))


def setting(value: Any) -> str:
    """A value as ``--set`` spells it (true/false, null, [a, b])."""
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(setting(v) for v in value) + "]"
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def dp_bw(k: Knobs, hw: "Hardware") -> float:
    lay = k.layout
    return hw.link_bw(spans_nodes=lay.tensor_size * lay.context_size * lay.data_size > hw.gpus_per_node)


def busiest_split(arch: Arch, k: Knobs) -> tuple[int, int]:
    """(dense, expert) parameters of the pipeline stage that holds the most (first, last or the busiest MoE stage)."""
    lay, v = k.layout, k.virtual
    t, p = lay.tensor_size, lay.pipeline_size
    shards = lay.expert_size * lay.expert_tensor_size
    first, last = lay.first_stage_layers, lay.last_stage_layers
    busiest = busiest_moe_stage(arch, p, v, first, last)
    stages = {0, p - 1} | ({busiest} if busiest is not None else set())
    return max((stage_split(arch, t, p, s, shards, v, first, last) for s in stages), key=sum)
