"""Rules refusing values that do nothing because the feature they belong to is off in the recipe that runs: another
backend kind's options, and FP8's scaling recipe with ``training.fp8: null``.

A value is *set* when the recipe wrote it (file, site file, profile, ``--set``) or it differs from its default. It is
left alone when a layer above the one that set it turned the feature off or chose another kind (``recipe.provenance``:
the deepseek_v3 recipe's local profile writes ``fp8: null`` over its FP8 settings; a sweep cell or ``--set
backend.kind=...`` picks another kind), or when it is a site file's default (a site sets options for every kind). The
rules are registered by ``recipe.rules`` (which imports them; this module imports nothing of it).
"""

from __future__ import annotations

from typing import Any, Iterator

from hpc_tools import backends
from hpc_tools.errors import Violation
from hpc_tools.layout import ParallelLayout
from hpc_tools.recipe.backend import BackendConfig
from hpc_tools.recipe.schema import Recipe
from hpc_tools.recipe.training import TrainingConfig

# backend.<kind> section -> {option field: its default} (the names ``recipe.reads`` finds the rule's reads by)
OPTIONS = {name: {f: i.get_default(call_default_factory=True) for f, i in info.annotation.model_fields.items()}
           for name, info in BackendConfig.model_fields.items() if name != "kind"}
FP8_RECIPE_DEFAULT = TrainingConfig.model_fields["fp8_recipe"].default


def set_options(section, name: str) -> list[tuple[str, Any]]:
    """(field, value) of the options section ``backend.<name>`` the recipe wrote or that differ from their
    default."""
    return [(field, getattr(section, field)) for field, default in OPTIONS[name].items()
            if field in section.model_fields_set or getattr(section, field) != default]


def _provenance(r: Recipe):
    """The recipe's ``recipe.provenance.Provenance`` (set by ``resolve``; None: judged by what it holds alone). Read
    as an attribute: importing that module here would close an import cycle through the site file's reader."""
    return r._provenance


def fp8_recipe_without_fp8(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """training.fp8_recipe written beside training.fp8: null does nothing (the rule in ``settings_take_effect``
    covers fp8 left out); an fp8: null from a layer above the recipe's FP8 settings turns them off on purpose."""
    t, known = r.training, _provenance(r)
    if known is None or t.fp8 is not None or "fp8" not in t.model_fields_set:
        return
    written = "fp8_recipe" in t.model_fields_set or t.fp8_recipe != FP8_RECIPE_DEFAULT
    if written and not known.switched_above(r, "training.fp8", "training.fp8_recipe"):
        yield Violation("training.fp8_recipe", t.fp8_recipe, "is read only with training.fp8, which is null here "
                        "(no FP8 GEMMs: the scaling recipe does nothing)",
                        "set training.fp8: e4m3 or hybrid, or remove fp8_recipe")


def other_backend_options(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """Options of a backend kind the recipe does not train with (backend.deepspeed.* with backend.kind: horovod) are
    never read; the first one set is named, with the kind that reads it."""
    known = _provenance(r)
    if known is None:
        return
    b, ours = r.backend, backends.backend(r.backend.kind).options
    # each section by name, so that ``validate --explain`` finds the fields this rule reads (recipe.reads)
    found = {"megatron": set_options(b.megatron, "megatron"), "deepspeed": set_options(b.deepspeed, "deepspeed"),
             "fsdp": set_options(b.fsdp, "fsdp"), "horovod": set_options(b.horovod, "horovod")}
    for section, options in found.items():
        if section == ours:
            continue
        kind = next(k for k in backends.KINDS if backends.backend(k).options == section)
        for name, value in options:
            path = f"backend.{section}.{name}"
            if not known.switched_above(r, "backend.kind", path):
                yield Violation(path, value, f"is an option of backend.kind={kind}, and this recipe trains with "
                                f"backend.kind={r.backend.kind}, which never reads it",
                                f"remove {path}, or set backend.kind: {kind}")
                return
