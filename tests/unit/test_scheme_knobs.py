"""Each sharding scheme's knobs type (hpc_tools/planner/sharding/, ``Scheme.knobs``) covers exactly the options its
backend reads: every option field is an option of the backend's own section that the backend's training package reads,
every other option of that section is named in ``elsewhere`` (so a new option is decided, not forgotten), each knob
follows the recipe's value, is written back by ``--set`` unless ``kept``, and the derived DeepSpeed keys are the ones
the generated ds_config hands to DeepSpeed."""

from __future__ import annotations

import ast
import typing
from dataclasses import fields
from functools import lru_cache
from importlib import import_module
from pathlib import Path

import pytest

from hpc_tools import backends
from hpc_tools.layout import ParallelLayout
from hpc_tools.planner import sharding
from hpc_tools.planner.knobs import Knobs, apply_knobs
from hpc_tools.recipe.load import resolve
from tests.unit.inline_recipes import SMALL_DENSE

MODEL_KINDS = backends.with_feature("trains_model")


def recipe(kind: str, options: dict | None = None):
    own = {backends.backend(kind).options: options} if options else {}
    return resolve({**SMALL_DENSE, "backend": {"kind": kind, **own}}, [], check=False)


def section_fields(kind: str) -> dict:
    """The pydantic fields of backend ``kind``'s own options section."""
    r = recipe(kind)
    return type(getattr(r.backend, backends.backend(kind).options)).model_fields


@lru_cache(maxsize=None)
def attributes_read(trainer: str) -> frozenset[str]:
    """Every attribute name the backend's training package reads (``x.name`` anywhere in its modules)."""
    package = Path(import_module(trainer.rsplit(".", 1)[0]).__file__).parent
    return frozenset(node.attr for path in package.rglob("*.py")
                     for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Attribute))


def other_value(annotation, value):
    """A valid value of an option other than ``value`` (a bool flipped, another Literal choice, another size)."""
    if annotation is bool:
        return not value
    choices = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Literal:
        return next(c for c in choices if c != value)
    return 4 if value in (None, 128) else value // 2  # int or int | None: shard_size, fusion_threshold_mb


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_knobs_cover_exactly_the_options_the_backend_reads(kind):
    row, knobs = backends.backend(kind), sharding.of(kind).knobs
    options, section = set(knobs.options()), set(section_fields(kind))
    assert options, kind
    assert options <= section, sorted(options - section)  # read from the section by name
    assert options <= attributes_read(row.trainer), sorted(options - attributes_read(row.trainer))
    assert not options & set(knobs.elsewhere)
    assert options | set(knobs.elsewhere) == section, sorted(section - options - set(knobs.elsewhere))
    assert set(knobs.written()) <= options


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_each_knob_follows_the_recipe_and_is_written_back(kind):
    row, knobs = backends.backend(kind), sharding.of(kind).knobs
    spec = section_fields(kind)
    default = Knobs.from_recipe(recipe(kind)).sharding
    for name in knobs.options():
        value = other_value(spec[name].annotation, getattr(default, name))
        changed = {name: value, **({"strategy": "hybrid_shard"} if name == "shard_size" else {})}
        r = recipe(kind, changed)
        k = Knobs.from_recipe(r)
        assert type(k.sharding) is knobs and getattr(k.sharding, name) == value, (name, value)
        written = [o for o in k.overrides() if o.startswith(f"backend.{row.options}.{name}=")]
        assert written == ([f"backend.{row.options}.{name}={sharding.setting(value)}"]
                           if name in knobs.written() else []), (name, written)
        # applying the default's knobs to the changed recipe undoes exactly the written ones
        back = getattr(apply_knobs(r, Knobs.from_recipe(recipe(kind))).backend, row.options)
        assert getattr(back, name) == (getattr(default, name) if name in knobs.written() else value), name


def test_zero_knobs_derived_keys_are_what_the_ds_config_hands_deepspeed():
    from hpc_tools.train.deepspeed.ds_config import build_ds_config

    derived = [f for f in fields(sharding.ZeroKnobs) if "source" in f.metadata]
    assert {f.name for f in derived} == {"overlap_comm", "reduce_bucket_size"}
    plain = Knobs.from_recipe(recipe("deepspeed", {"zero_stage": 3})).sharding
    assert plain.overlap_comm is True and plain.reduce_bucket_size == sharding.DS_DEFAULT_BUCKET_ELEMS
    assert Knobs.from_recipe(recipe("deepspeed", {"zero_stage": 1})).sharding.overlap_comm is False
    set_ = {"overlap_comm": False, "reduce_bucket_size": 12_345_678}
    r = recipe("deepspeed", {"zero_stage": 3, "config_overrides": {"zero_optimization": set_}})
    k = Knobs.from_recipe(r)
    config = build_ds_config(r, ParallelLayout.from_recipe(r), device_type="cuda")
    for f in derived:
        section, key = f.metadata["source"].split(".")
        assert config[section][key] == getattr(k.sharding, f.name) == set_[f.name], f.name
        assert not any(o.split("=")[0].endswith(f".{f.name}") for o in k.overrides())  # never written back
