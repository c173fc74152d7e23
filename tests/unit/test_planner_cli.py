"""`python -m hpc_tools plan`: the table, --json, --search, exit codes and one-line errors."""

from __future__ import annotations

import json

import pytest

from hpc_tools.cli import main
from hpc_tools.layout import ParallelLayout
from hpc_tools.recipe.load import load_recipe
from tests.helpers import REPO

GPT3D = str(REPO / "recipes/gpt_3d.yaml")
NO_CAL = ["--calibration", "/nonexistent/calibration.json"]


def test_table_shows_every_term_and_the_verdict(capsys):
    assert main(["plan", GPT3D, *NO_CAL]) == 0
    out = capsys.readouterr().out
    for word in ("parameters", "gradients", "optimizer states", "activations", "CUDA context", "pipeline bubble",
                 "tensor-parallel comm", "FITS", "tokens/s", "MFU", "Korthikanti"):
        assert word in out, word


def test_json_plan(capsys):
    assert main(["plan", GPT3D, "--json", *NO_CAL]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["ok"] and d["fits"] and d["violations"] == []
    terms = {t["name"]: t for t in d["memory"]["terms"]}
    assert sum(t["bytes"] for t in terms.values()) == pytest.approx(d["memory"]["total_bytes"])
    assert all(t["assumes"] for t in terms.values())
    st = d["step_time"]
    r = load_recipe(GPT3D)
    tokens = ParallelLayout.from_recipe(r).global_batch_size * r.model.seq_length
    assert st["tokens_per_s"] == pytest.approx(tokens / st["total_s"])
    assert 0 < st["mfu"] < 1 and st["efficiency_source"].startswith("default")


def test_does_not_fit_exits_1_with_the_violation(capsys):
    big = ["--set", "model.num_layers=48", "--set", "model.hidden_size=8192", "--set", "model.num_attention_heads=64",
           "--set", "parallel.virtual_pipeline_size=null"]
    assert main(["plan", GPT3D, *big, "--json", *NO_CAL]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["fits"] is False and d["violations"][0]["path"] == "cluster.gpu_type"
    assert main(["plan", GPT3D, *big, *NO_CAL]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_search_json(capsys):
    assert main(["plan", GPT3D, "--search", "--top", "3", "--losers", "2", "--json", *NO_CAL]) == 0
    d = json.loads(capsys.readouterr().out)
    assert len(d["top"]) == 3 and len(d["next"]) == 2
    assert all(n["why"] for n in d["next"])
    assert d["top"][0]["step_s"] <= d["top"][1]["step_s"] <= d["next"][0]["step_s"]
    assert any(o.startswith("parallel.tensor_size=") for o in d["top"][0]["overrides"])


def test_search_table(capsys):
    assert main(["plan", GPT3D, "--search", "--top", "2", *NO_CAL]) == 0
    out = capsys.readouterr().out
    assert "Why the next ones lose" in out and "Apply the best: --set parallel.tensor_size=" in out


@pytest.mark.parametrize("argv, needle", [
    (["plan"], "needs a recipe"),
    (["plan", GPT3D, "--efficiency", "2"], "--efficiency"),
    (["plan", GPT3D, "--set", "parallel.tensor_size=3"], "parallel.tensor_size=3"),
    (["plan", "nope.yaml"], "does not exist"),
    (["plan", str(REPO / "recipes/comm_check.yaml")], "nothing to plan"),
])
def test_bad_input_is_one_line_exit_2(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and needle in err[0]


def test_plan_shows_and_takes_the_headroom(capsys):
    assert main(["plan", GPT3D, "--json", *NO_CAL]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["headroom_bytes"] == pytest.approx(0.05 * d["gpu_mem_bytes"] + 1e9)
    assert d["usable_bytes"] == pytest.approx(d["gpu_mem_bytes"] - d["headroom_bytes"])
    assert main(["plan", GPT3D, "--headroom", "12", "--json", *NO_CAL]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["headroom_bytes"] == pytest.approx(12e9) and d["headroom"] == "cluster.memory_headroom_gb=12"
    assert main(["plan", GPT3D, *NO_CAL]) == 0
    assert "headroom" in capsys.readouterr().out
    assert main(["plan", GPT3D, "--search", "--headroom", "70", "--json", *NO_CAL]) == 0
    d = json.loads(capsys.readouterr().out)
    assert all(c["memory_bytes"] <= d["usable_bytes"] for c in d["top"]) and d["usable_bytes"] < 16e9
    assert main(["plan", GPT3D, "--headroom", "-1"]) == 2
