"""Training on prepared data: `data prepare` -> a 2-dataset blend with a train/valid/test split -> Megatron-core TP2
on 2 gloo ranks, where a resume from a checkpoint gives the uninterrupted losses bit for bit, and DeepSpeed ZeRO-2
(recipes/gpt_zero.yaml's local profile through `submit`) on the same blend.

Run without RANK this file is a pytest module; with RANK (started by ``hpc_tools.testing.spawn``) it is one rank of
the Megatron case.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
STEPS, RESUME_AT = 4, 2


def blend(data: Path) -> list[dict]:
    return [{"path": str(data / "web"), "weight": 0.6}, {"path": str(data / "code"), "weight": 0.4}]


def megatron_recipe(data: Path):
    from hpc_tools.recipe.load import resolve

    return resolve({
        "name": "indexed_tp2",
        "model": {"family": "gpt", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
                  "vocab_size": 512, "hidden_dropout": 0.0, "attention_dropout": 0.0},
        "parallel": {"tensor_size": 2, "pipeline_size": 1, "data_size": -1},
        "training": {"micro_batch_size": 2, "global_batch_size": 4, "train_iters": STEPS, "lr": 2e-3,
                     "precision": "fp32", "seed": 1234},
        "backend": {"kind": "megatron"},
        "data": {"source": "indexed", "blend": blend(data), "split": "90,5,5"},
        "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu_type": "cpu", "cpus_per_task": 1},
    }, source="test_indexed_training")


def rank_main(data: Path, out: Path) -> None:
    """Steps 1..STEPS uninterrupted (saving at RESUME_AT), then a fresh engine resumed from that checkpoint."""
    import torch.distributed as dist

    sys.path.insert(0, str(HERE))
    import megatron_driver as driver

    from hpc_tools.checkpoints.dirs import CheckpointDirs
    from hpc_tools.layout import ParallelLayout
    from hpc_tools.train.checkpointing.saver import save_once
    from hpc_tools.train.data import validation_samples
    from hpc_tools.train.megatron import checkpoint
    from hpc_tools.train.megatron.engine import MegatronCore
    from hpc_tools.train.megatron.trainer import _quiet_megatron

    _quiet_megatron()
    from hpc_tools.runtime.distenv import join_world

    join_world("gloo")
    recipe = megatron_recipe(data)
    layout = ParallelLayout.from_recipe(recipe)
    dirs = CheckpointDirs(out.parent / "ckpt")
    engine = MegatronCore(recipe, layout, "cpu")
    first, _ = driver.run_steps(engine, recipe, layout, 1, RESUME_AT)
    save_once(checkpoint.Shards(engine), dirs, RESUME_AT)
    rest, _ = driver.run_steps(engine, recipe, layout, RESUME_AT + 1, STEPS)
    engine.close()
    engine = MegatronCore(recipe, layout, "cpu")
    step = checkpoint.load(engine, dirs.newest())
    resumed, _ = driver.run_steps(engine, recipe, layout, step + 1, STEPS)
    engine.close()
    valid = validation_samples(recipe)
    if dist.get_rank() == 0:
        out.write_text(json.dumps({"uninterrupted": first + rest, "resumed_at": step, "resumed": resumed,
                                   "valid_samples": len(valid) if valid is not None else 0}))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """Two generated corpora (prose and code-like lines), prepared with 2 workers through the CLI."""
    from tests.helpers import run_cli

    root = tmp_path_factory.mktemp("indexed")
    rng = np.random.default_rng(0)
    words = "data parallel tensor pipeline stage rank gradient shard step loss".split()
    with open(root / "web.jsonl", "w") as f:
        for _ in range(400):
            f.write(json.dumps({"text": " ".join(rng.choice(words, size=int(rng.integers(5, 80))))}) + "\n")
    with open(root / "code.jsonl", "w") as f:
        for i in range(300):
            f.write(json.dumps({"text": "\n".join(f"x{j} = f(x{j - 1}, {i})" for j in range(1, 12))}) + "\n")
    proc = run_cli("data", "prepare", str(root / "web.jsonl"), str(root / "code.jsonl"), "--out", str(root / "data"),
                   "--workers", "2", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["documents"] == 700 and report["tokens"] > 50_000
    return root / "data"


@pytest.mark.megatron
def test_megatron_tp2_on_a_blend_resumes_to_the_uninterrupted_losses(prepared, tmp_path):
    from hpc_tools.testing.spawn import spawn_ranks

    out = tmp_path / "losses.json"
    spawn_ranks([sys.executable, __file__, str(prepared), str(out)], 2, env={"PYTHONWARNINGS": "ignore"},
                timeout_s=600, check=True)
    result = json.loads(out.read_text())
    losses = result["uninterrupted"]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(math.log(512), abs=0.6)  # an untrained model on real tokens
    assert result["resumed_at"] == RESUME_AT
    assert result["resumed"] == losses[RESUME_AT:], result  # bit-identical
    assert result["valid_samples"] > 0


@pytest.mark.deepspeed
def test_deepspeed_zero2_trains_on_the_same_blend(prepared, tmp_path):
    from tests.helpers import loss_curve, run_cli

    value = json.dumps(blend(prepared))
    proc = run_cli("submit", str(REPO / "recipes" / "gpt_zero.yaml"), "--executor", "local", "--json",
                   "--runs-dir", str(tmp_path / "runs"), "--set", "training.train_iters=2",
                   "--set", "training.lr_warmup_iters=1", "--set", "data.source=indexed",
                   "--set", f"data.blend={value}", "--set", "data.split=90,5,5",
                   "--set", "checkpoint.interval_iters=0", timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    run_dir = Path(json.loads(proc.stdout)["run_dir"])
    losses = loss_curve(run_dir)
    assert sorted(losses) == [1, 2] and all(math.isfinite(x) for x in losses.values()), losses


if __name__ == "__main__":
    if "RANK" in os.environ:
        sys.path.insert(0, str(REPO))
        rank_main(Path(sys.argv[1]), Path(sys.argv[2]))
