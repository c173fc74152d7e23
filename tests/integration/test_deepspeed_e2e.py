"""recipes/gpt_zero.yaml, local profile, end to end: `submit` -> run folder -> local executor (one rank process each) ->
DeepSpeed ZeRO-2 on gloo -> records on every rank, checkpoints, manifest COMPLETED -> `export` -> from_pretrained.
Plus the data pipeline's resume position checked in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from hpc_tools.layout import ParallelLayout
from hpc_tools.recipe.load import load_recipe
from tests.helpers import REPO

RECIPE = REPO / "recipes" / "gpt_zero.yaml"


@pytest.fixture(scope="module")
def finished_run(main_command):
    """`submit recipes/gpt_zero.yaml --executor local`, shared with the other tests that read the same run
    (tests/conftest.py main_command)."""
    from hpc_tools.registry import RunFolder

    recipe = load_recipe(RECIPE, profile="local")
    out = main_command("recipes/gpt_zero.yaml")
    run = RunFolder(out["result"]["run_dir"]) if out["result"] else None
    return recipe, ParallelLayout.from_recipe(recipe), run, out


@pytest.mark.deepspeed
@pytest.mark.slow
def test_gpt_zero_local_profile_trains(finished_run):
    recipe, layout, run, out = finished_run
    logs = "".join(p.read_text(errors="replace")[-3000:] for p in sorted(run.logs_dir.glob("rank*.out"))) if run \
        else out["stderr"]
    assert out["returncode"] == 0 and run is not None, logs
    manifest = run.manifest()
    assert manifest["state"] == "COMPLETED", manifest
    assert recipe.backend.kind == "deepspeed" and layout.world_size == 2
    from profiling.records import read_jsonl

    per_rank = {p.name: list(read_jsonl(p)) for p in sorted(run.records_dir.glob("rank*.jsonl"))}
    assert sorted(per_rank) == ["rank00000.jsonl", "rank00001.jsonl"]
    steps = recipe.training.train_iters
    for name, rows in per_rank.items():
        assert [r["step"] for r in rows] == list(range(1, steps + 1)), name
        assert [r["dp_rank"] for r in rows] == [rows[0]["rank"]] * steps
        assert all(r["grad_norm"] is not None and r["lr"] > 0 for r in rows)
    loss = np.asarray([r["loss"] for r in per_rank["rank00000.jsonl"]])
    assert loss[0] == pytest.approx(np.log(recipe.model.vocab_size), abs=0.15)
    assert loss[-5:].mean() < loss[:5].mean() - 0.5, loss  # it learns the synthetic pattern
    assert np.allclose(loss, [r["loss"] for r in per_rank["rank00001.jsonl"]])


@pytest.mark.deepspeed
@pytest.mark.slow
def test_ds_config_and_checkpoints_in_the_run_folder(finished_run):
    from hpc_tools.checkpoints.dirs import CheckpointDirs
    from hpc_tools.train.deepspeed.ds_config import build_ds_config

    recipe, layout, run, _ = finished_run
    written = json.loads((run.path / "ds_config.json").read_text())
    assert written == build_ds_config(recipe, layout)
    assert (written["train_batch_size"], written["gradient_accumulation_steps"]) == (8, 2)
    assert written["zero_optimization"]["stage"] == 2
    dirs = CheckpointDirs(run.checkpoints_dir)
    assert [s for s, _ in dirs.complete()] == [20, 30]  # interval 10, keep_last 2
    assert CheckpointDirs.read_meta(dirs.newest())["layout"] == layout.describe()


@pytest.mark.deepspeed
@pytest.mark.slow
def test_export_cli_gives_a_from_pretrained_folder(finished_run, tmp_path, capsys):
    import torch
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from hpc_tools.cli import main

    recipe, _, run, _ = finished_run
    out = tmp_path / "hf"
    assert main(["export", str(run.path), "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ok"] and summary["step"] == 30
    model = AutoModelForCausalLM.from_pretrained(out)
    assert isinstance(model, LlamaForCausalLM)
    assert model.config.num_key_value_heads == 2 and model.config.intermediate_size == 176
    assert not model.config.tie_word_embeddings
    assert summary["parameters"] == sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.arange(16).unsqueeze(0)).logits).all()
    # a second export never overwrites
    assert main(["export", str(run.path), "--out", str(out)]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert main(["export", str(run.path), "--out", str(tmp_path / "x"), "--step", "7"]) == 2
    assert "complete steps: 20, 30" in capsys.readouterr().err


FRESH = """
import hashlib, sys
sys.path.insert(0, {repo!r})
from hpc_tools.recipe.load import load_recipe
from hpc_tools.layout import ParallelLayout
from hpc_tools.train.data import build_samples, microbatches_for_step
r = load_recipe({recipe!r}, profile="local")
lay = ParallelLayout.from_recipe(r)
s = build_samples(r)
h = hashlib.sha256()
for d in range(lay.data_size):
    for mb in microbatches_for_step(s, {step}, d, lay):
        h.update(mb["tokens"].numpy().tobytes()); h.update(mb["labels"].numpy().tobytes())
print(h.hexdigest())
"""


def test_data_position_is_the_step_in_a_fresh_process():
    """Step k's batches are the same in a new process (what a resumed job sees) as here after steps 1..k-1."""
    import hashlib

    from hpc_tools.train.data import build_samples, microbatches_for_step

    r = load_recipe(RECIPE, profile="local")
    lay = ParallelLayout.from_recipe(r)
    samples = build_samples(r)
    for step in range(1, 17):  # consume steps as training would, then hash step 17
        microbatches_for_step(samples, step, 0, lay)
    h = hashlib.sha256()
    for d in range(lay.data_size):
        for mb in microbatches_for_step(samples, 17, d, lay):
            h.update(mb["tokens"].numpy().tobytes())
            h.update(mb["labels"].numpy().tobytes())
    out = subprocess.run([sys.executable, "-c", FRESH.format(repo=str(REPO), recipe=str(RECIPE), step=17)],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == h.hexdigest()
