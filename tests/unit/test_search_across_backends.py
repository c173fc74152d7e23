"""`plan --search --backends`: the layout search across the trains-model rows of the backend table, ranked together,
each kind's best equal to a search of that kind alone, kinds whose rules the recipe cannot meet dropped with the reason;
the default search (the recipe's own kind) keeps its labels and overrides."""

from __future__ import annotations

import json

import pytest

from hpc_tools import backends
from hpc_tools.cli import main
from hpc_tools.errors import UserError
from hpc_tools.planner import search
from hpc_tools.planner.knobs import Knobs
from hpc_tools.planner.search import parse_kinds, search_across
from hpc_tools.recipe.load import resolve
from tests.helpers import REPO

NO_CAL = ["--calibration", "/nonexistent/calibration.json"]
LLAMA_8B = {"family": "llama", "num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
            "num_query_groups": 8, "ffn_hidden_size": 14336, "seq_length": 8192, "vocab_size": 128256}
BASE = {"name": "across", "model": LLAMA_8B,
        "training": {"micro_batch_size": 1, "global_batch_size": 64, "precision": "bf16",
                     "recompute_granularity": "full"},
        "backend": {"kind": "fsdp"},
        "cluster": {"nodes": 2, "gpus_per_node": 8, "gpu_type": "H100-SXM"}}
ALL = ["megatron", "deepspeed", "fsdp"]


def recipe(*overrides: str, check: bool = False):
    return resolve(BASE, list(overrides), check=check)


@pytest.fixture(scope="module")
def across():
    # one efficiency for every kind, so that the three interleave in the ranking checked here (uncalibrated, each kind
    # starts from its own layers' default: tests/unit/test_efficiency_defaults.py)
    return search_across(recipe(), ALL, top=5, losers=40, efficiency=0.6)


def test_all_means_the_rows_that_train_a_model():
    assert parse_kinds("all") == backends.with_feature("trains_model") == [*ALL, "horovod"]
    assert parse_kinds(" fsdp, megatron,fsdp") == ["fsdp", "megatron"]
    for bad, needle in (("comm_check", "comm_check"), ("megatron,nope", "nope"), (",", "no kind")):
        with pytest.raises(UserError, match=f"--backends .*{needle}.* is not a backend kind .*megatron, deepspeed"):
            parse_kinds(bad)


def test_the_8b_recipe_gets_every_kind_ranked_together(across):
    assert [k.kind for k in across.kinds] == ALL and all(k.best and not k.reason for k in across.kinds)
    assert {c.knobs.backend for c in across.ranked} == set(ALL)  # the three kinds interleave in the one ranking
    times = [c.step_s for c in across.ranked]
    assert times == sorted(times) and len(times) == 45
    assert across.best.step_s == min(k.best.step_s for k in across.kinds)
    assert across.enumerated == sum(k.enumerated for k in across.kinds) == across.too_big + across.fitting
    for c in across.ranked:
        assert c.memory_bytes <= across.usable_bytes
        assert across.label(c) == f"{c.knobs.backend} {c.knobs.describe()}"


@pytest.mark.parametrize("kind", ALL)
def test_each_kinds_best_is_what_a_search_of_that_kind_alone_returns(across, kind):
    alone = search(recipe(f"backend.kind={kind}"), top=5, losers=40, efficiency=0.6)
    best = next(k.best for k in across.kinds if k.kind == kind)
    assert alone.kinds == [] and best.knobs == alone.best.knobs and best.step_s == alone.best.step_s
    assert next(k.enumerated for k in across.kinds if k.kind == kind) == alone.enumerated
    # the labels and overrides of a single-kind search stay as they were
    assert alone.label(alone.best) == alone.best.knobs.describe()
    assert alone.overrides(alone.best) == alone.best.knobs.overrides()


def test_overrides_carry_the_kind_and_rebuild_the_candidate(across):
    """The --set strings of each kind's best, applied to the recipe as written (fsdp), give a valid recipe of that
    kind with that configuration: backend.kind=... comes first and the row's options section follows."""
    for k in across.kinds:
        sets = across.overrides(k.best)
        assert sets[0] == f"backend.kind={k.kind}"
        assert any(s.startswith(f"backend.{backends.backend(k.kind).options}.") for s in sets)
        applied = recipe(*sets, check=True)  # the rules hold, else RecipeError
        assert applied.backend.kind == k.kind
        assert Knobs.from_recipe(applied).describe() == k.best.knobs.describe()


def test_a_rule_a_kind_cannot_meet_drops_that_kind_with_its_reason():
    # LayerNorm in a llama is a Megatron-only option: the Hugging Face classes (deepspeed, fsdp) cannot express it
    res = search_across(recipe("model.normalization=LayerNorm"), ALL, top=3, losers=0, use_calibration=False)
    kept = {k.kind: k for k in res.kinds}
    assert kept["megatron"].best and {c.knobs.backend for c in res.ranked} == {"megatron"}
    for kind in ("deepspeed", "fsdp"):
        assert kept[kind].best is None
        assert "model.normalization=LayerNorm" in kept[kind].reason and "backend.kind: megatron" in kept[kind].reason
    # and one deepspeed lacks (async checkpoints) drops deepspeed, with the reason
    res = search_across(recipe("checkpoint.async_save=true"), ALL, top=3, losers=0, use_calibration=False)
    assert sorted(k.kind for k in res.kinds if k.best) == ["fsdp", "megatron"]
    assert [k.kind for k in res.kinds if not k.best] == ["deepspeed"]
    assert all("checkpoint.async_save=true" in k.reason and "decoupled checkpoint engine" in k.reason
               for k in res.kinds if not k.best)


def test_a_kind_nothing_fits_is_dropped_for_memory():
    one_gpu = recipe("cluster.nodes=1", "cluster.gpus_per_node=1", "training.global_batch_size=8")
    res = search_across(one_gpu, ["megatron", "fsdp"], top=3, losers=0, use_calibration=False)
    assert res.best is None
    assert all(k.best is None and "fits in" in k.reason and "GB per GPU" in k.reason for k in res.kinds)


def test_cli_json_and_table(capsys):
    llama = str(REPO / "recipes/llama_fsdp.yaml")
    assert main(["plan", llama, "--search", "--backends", "megatron,fsdp", "--top", "3", "--losers", "3", "--json",
                 *NO_CAL]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [b["kind"] for b in d["backends"]] == ["megatron", "fsdp"] and all(b["best"] for b in d["backends"])
    for c in d["top"] + d["next"]:
        kind = c["config"].split()[0]
        assert kind in ("megatron", "fsdp") and c["overrides"][0] == f"backend.kind={kind}"
    assert main(["plan", llama, "--search", "--backends", "all", "--top", "2", *NO_CAL]) == 0
    out = capsys.readouterr().out
    assert "Best of each backend kind" in out and "Apply the best: --set backend.kind=" in out
    # the default search is unchanged: no kinds table, labels and overrides without the kind
    assert main(["plan", llama, "--search", "--top", "2", "--json", *NO_CAL]) == 0
    d = json.loads(capsys.readouterr().out)
    assert "backends" not in d and d["top"][0]["config"].startswith("TP")
    assert not any(o.startswith("backend.kind=") for o in d["top"][0]["overrides"])


@pytest.mark.parametrize("argv, needle", [
    (["--backends", "all"], "use it with --search"),
    (["--search", "--backends", "all", "--measure", "2"], "without --measure"),
    (["--search", "--backends", "comm_check"], "--backends comm_check"),
])
def test_bad_flags_are_one_line_exit_2(capsys, argv, needle):
    assert main(["plan", str(REPO / "recipes/llama_fsdp.yaml"), *argv, *NO_CAL]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]
