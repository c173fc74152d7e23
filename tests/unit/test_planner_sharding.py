"""Sharding schemes and layer codes as the planner's classes (hpc_tools/planner/sharding/, memory.LayerCode): every
backend that trains a model names a known scheme and layer code in its row, a scheme's knobs are the ones the search
turns and writes back to the backend's options section, and a search row names its scheme."""

from __future__ import annotations

from dataclasses import fields

import pytest

from hpc_tools import backends
from hpc_tools.planner import sharding
from hpc_tools.planner.dimensions import DIMENSIONS
from hpc_tools.planner.knobs import Knobs
from hpc_tools.planner.memory import LAYER_CODES, layers_of
from hpc_tools.planner.report import search_dict
from hpc_tools.planner.search import enumerate_knobs, search_across
from hpc_tools.recipe.load import resolve
from tests.unit.inline_recipes import SMALL_DENSE

MODEL_KINDS = backends.with_feature("trains_model")


def recipe(kind: str):
    return resolve({**SMALL_DENSE, "backend": {"kind": kind}}, [], check=False)


def test_every_model_backend_names_a_known_scheme_and_layer_code():
    assert MODEL_KINDS
    for kind in MODEL_KINDS:
        row = backends.backend(kind)
        assert sharding.of(kind) is sharding.SCHEMES[row.sharding]
        assert layers_of(Knobs.from_recipe(recipe(kind))) is LAYER_CODES[row.layers]
    assert {backends.backend(k).sharding for k in MODEL_KINDS} == set(sharding.SCHEMES)


def test_scheme_dimensions_are_knobs_fields_labelled_with_their_backends():
    names = {f"sharding.{f.name}" for s in sharding.SCHEMES.values() for f in fields(s.knobs)}
    for label, attrs in sharding.dimensions():
        assert set(attrs) <= names
        assert (label, attrs) in DIMENSIONS
    assert "distributed optimizer (megatron)" in [label for label, _ in DIMENSIONS]


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_search_turns_only_its_schemes_knobs(kind):
    """The sharding knobs the search varies for a kind are its scheme's, and the --set strings write the scheme's
    knobs as fields of the backend's own options section."""
    r = recipe(kind)
    base = Knobs.from_recipe(r)
    scheme = base.scheme
    assert type(base.sharding) is scheme.knobs
    own = set(scheme.dimension[1]) | {"shard_size"}
    seen = set()
    for k in enumerate_knobs(r, base):
        assert type(k.sharding) is scheme.knobs  # no other scheme's knobs on this kind's candidates
        seen |= {f.name for f in fields(k.sharding) if getattr(k.sharding, f.name) != getattr(base.sharding, f.name)}
    assert seen <= own and (seen or not scheme.dimension[1])  # Horovod's scheme turns nothing
    section = f"backend.{base.row.options}."
    written = {o.split("=")[0][len(section):] for o in base.overrides() if o.startswith(section)}
    assert written and written <= set(type(getattr(r.backend, base.row.options)).model_fields)


def test_search_rows_name_their_scheme():
    result = search_across(recipe("megatron"), MODEL_KINDS, top=3, losers=0, efficiency=0.5)
    out = search_dict(result)
    rows = out["top"] + [b["best"] for b in out["backends"] if b["best"]]
    assert {row["scheme"] for row in out["top"]} <= set(sharding.SCHEMES)
    for row in rows:
        kind = row["overrides"][0].split("=")[1]
        assert row["scheme"] == backends.backend(kind).sharding
    assert len({b["best"]["scheme"] for b in out["backends"] if b["best"]}) == len(MODEL_KINDS)
