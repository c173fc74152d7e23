"""Which layer of a recipe wrote a value: the recipe file, the site file's defaults, or a layer above the recipe (its
``local:`` profile when applied, ``--set`` overrides, a sweep cell's values).

The no-op rules (``hpc_tools.recipe.noops``) need it: an option of a feature that is off does nothing, and is refused,
unless the feature was turned off (or the backend kind changed) by a layer above the one that set the option -- the
deepseek_v3 recipe's FP8 settings under its local profile's ``fp8: null``, a sweep cell changing ``backend.kind``.
``resolve`` stamps each recipe it builds from layers (``stamp``); a recipe without a stamp (a run folder's resolved
recipe, where every default is written out, or a copy the planner validated afresh) is judged by what it holds alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

# The switches the no-op rules read: the value each had when the recipe was resolved. A later copy that changes one
# (the planner's search trying another backend kind) changed it above the recipe's layers.
SWITCHES = ("backend.kind", "training.fp8")


@dataclass(frozen=True)
class Provenance:
    above: dict[str, int] = field(default_factory=dict)
    """Dotted path -> the highest layer above the recipe file that wrote it (1: the profile, 2: --set and sweep
    cells); the recipe file is layer 0."""
    site: frozenset[str] = frozenset()
    """Dotted paths the site file sets (defaults for every recipe, of every backend kind)."""
    switches: dict[str, Any] = field(default_factory=dict)
    """``SWITCHES``' values when the recipe was resolved."""

    def switched_above(self, recipe, switch: str, option: str) -> bool:
        """Whether ``switch`` was set above the layer that wrote ``option`` (so the option is the lower layer's,
        turned off on purpose), or the option is a site default."""
        if option in self.site:
            return True
        if self.switches.get(switch, _value(recipe, switch)) != _value(recipe, switch):
            return True
        return self.above.get(switch, 0) > self.above.get(option, 0)


def _value(recipe, path: str) -> Any:
    node = recipe
    for part in path.split("."):
        node = getattr(node, part, None)
    return node


def paths(data: Any, prefix: str = "") -> set[str]:
    """Every dotted key path of a nested mapping (a section and each of its keys)."""
    out: set[str] = set()
    if isinstance(data, dict):
        for key, value in data.items():
            path = f"{prefix}{key}"
            out.add(path)
            out |= paths(value, path + ".")
    return out


def looks_resolved(raw: Any) -> bool:
    """Whether ``raw`` is a recipe ``dump_resolved`` wrote (a run folder's recipe.yaml, read by any path): every
    section written out, and under ``backend:`` every kind's options -- which no hand-written recipe needs. Its values
    carry no layers, so it is judged by what it holds alone (as it was when first resolved)."""
    from hpc_tools.recipe.backend import BackendConfig
    from hpc_tools.recipe.schema import Recipe

    if not isinstance(raw, dict) or not isinstance(raw.get("backend"), dict):
        return False
    sections = [k for k, info in Recipe.model_fields.items() if k not in ("local", "sweep", "description")
                and isinstance(info.annotation, type)]
    options = [k for k in BackendConfig.model_fields if k != "kind"]
    return all(k in raw for k in sections) and all(isinstance(raw["backend"].get(k), dict) for k in options)


def stamp(recipe, profile_block: Any, override_paths: Iterable[str]) -> None:
    """Record on ``recipe`` what the layers above its file wrote (``override_paths``: what --set and sweep cells
    wrote, a mapping value's keys included), and the site file's paths."""
    from hpc_tools.recipe.site import read_site

    try:
        _, site = read_site()
    except Exception:  # noqa: BLE001 - read_yaml told a bad site file already; here it only exempts its defaults
        site = {}
    above = {p: 1 for p in paths(profile_block if isinstance(profile_block, dict) else {})}
    above.update({p: 2 for p in override_paths})
    recipe._provenance = Provenance(above, frozenset(paths(site)),
                                    {s: _value(recipe, s) for s in SWITCHES})


def provenance(recipe) -> Provenance | None:
    """The recipe's stamp; None for a recipe not resolved from layers here."""
    return getattr(recipe, "_provenance", None)
