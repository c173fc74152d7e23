"""backend.kind: fsdp on real gloo ranks: FSDP2 full_shard, HSDP, DDP and FSDP x TP (2 x 2 mesh) train the same tiny
Llama to the same losses; bf16 and activation checkpointing track fp32; a stop and resume continues exactly; a
Distributed Checkpoint saved at 4 ranks resumes at 2 (and under DDP) with the uninterrupted losses; ``export`` gives
an HF folder whose loss on the validation batches is the run's own val_loss; one tiny Llama from one HF folder trains
to the same losses under FSDP2, DDP and Megatron-core (TP1 PP1) over 20 steps.

Two launches (``hpc_tools.testing.matrix``): every 4-rank variant in one, every 2-rank one in the other. The
Megatron variant runs last in its launch: Megatron's CPU routes (``train/megatron/cpu_compat.py``) replace torch
functions for the whole process, and an FSDP run after them in the same process is not the FSDP of a fresh one.
"""

from __future__ import annotations

import numpy as np
import pytest

from hpc_tools.testing.matrix import launch

pytestmark = pytest.mark.slow

STEPS = 10
LLAMA = {"family": "llama", "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
         "ffn_hidden_size": 64, "seq_length": 32, "vocab_size": 512}
GPT = {"family": "gpt", "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 32,
       "vocab_size": 512}
FP32_TOL = 1e-4
"""fp32 under another strategy or rank count: the same math up to the order of the reductions."""
BF16_TOL = 0.05
"""bf16 compute (fp32 reduction and master weights) against fp32 over 10 steps."""


EQUIVALENCE_STEPS = 20
CROSS_BACKEND_TOL = 1e-4
"""FSDP2 / DDP / Megatron-core from the same HF weights in fp32: different kernels and reduction orders only."""


def variant(name, *, strategy="full_shard", ranks=4, precision="fp32", model=LLAMA, recompute="none", shard=None,
            reshard=True, load_path=None, steps=STEPS, init_from_hf=None, kind="fsdp", async_save=False, tensor=1,
            **extra):
    fsdp = {"strategy": strategy, "reshard_after_forward": reshard, "shard_size": shard}
    recipe = {
        "name": name, "model": model,
        "training": {"micro_batch_size": 2, "global_batch_size": 16, "train_iters": steps, "lr": 4e-3,
                     "min_lr": 4e-4, "lr_warmup_iters": 2, "precision": precision, "recompute_granularity": recompute,
                     "eval_interval": steps, "eval_iters": 2},
        "parallel": {"tensor_size": tensor},
        "backend": {"kind": "fsdp", "fsdp": fsdp} if kind == "fsdp" else {"kind": kind},
        "checkpoint": {"interval_iters": 5, "load_path": load_path, "init_from_hf": init_from_hf,
                       "async_save": async_save},
        "cluster": {"nodes": 1, "gpus_per_node": ranks, "gpu_type": "cpu", "hang_timeout_min": 5},
        "profiling": {"summary_interval": 100},
    }
    return {"name": name, "recipe": recipe, **extra}


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return launch([
        variant("fs"),
        variant("ddp", strategy="ddp"),
        variant("hsdp", strategy="hybrid_shard", shard=2),
        variant("fs_stopped", stop_after=3),
        variant("fs_bf16_recompute", precision="bf16", recompute="full", reshard=False),
        variant("gpt_fs", model=GPT),
        variant("fs_async", async_save=True),
        variant("fs_tp2", tensor=2),
    ], 4, tmp_path_factory.mktemp("fsdp4"))


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A tiny Llama with Hugging Face's own initialisation (not the backends' ``initial_value``), saved as a folder."""
    import torch
    from transformers import AutoModelForCausalLM

    from hpc_tools.hf.config import hf_config
    from hpc_tools.recipe.load import resolve

    torch.manual_seed(7)
    folder = tmp_path_factory.mktemp("hf") / "llama-tiny"
    AutoModelForCausalLM.from_config(hf_config(resolve(variant("p", ranks=2)["recipe"]))).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def two(tmp_path_factory, four, hf_folder):
    from pathlib import Path

    saved = str(Path(four["fs"]["run_dir"]) / "checkpoints" / "iter_0000005")
    same = {"ranks": 2, "steps": EQUIVALENCE_STEPS, "init_from_hf": hf_folder}
    return launch([
        variant("fs2", ranks=2),
        variant("fs2_from_4", ranks=2, load_path=saved),
        variant("ddp2_from_4", ranks=2, strategy="ddp", load_path=saved),
        variant("fs2_from_async", ranks=2, load_path=saved.replace("/fs/", "/fs_async/")),
        variant("hf_fsdp", **same),
        variant("hf_ddp", strategy="ddp", **same),
        variant("hf_megatron", kind="megatron", **same),  # last: see the module docstring
    ], 2, tmp_path_factory.mktemp("fsdp2"))


def losses(results, name, first=1, last=STEPS):
    r = results[name]
    assert r["steps"] == list(range(first, last + 1)), f"{name}: steps {r['steps']}"
    return np.asarray(r["loss"], dtype=float)


def test_every_rank_records_the_same_global_loss(four):
    for name, r in four.items():
        assert r["records_per_rank"] == {f"rank{i:05d}": STEPS for i in range(4)}, name
        per_rank = list(r["loss_per_rank"].values())
        assert all(np.allclose(x, per_rank[0], rtol=0, atol=1e-6) for x in per_rank), name


def test_loss_falls(four):
    for name in four:
        curve = losses(four, name)
        assert np.isfinite(curve).all(), name
        assert curve[0] == pytest.approx(np.log(512), abs=0.15), f"{name}: step-1 loss {curve[0]} is not ~ln(V)"
        assert curve[-1] < curve[0] - 0.3, f"{name}: loss did not fall: {curve}"


@pytest.mark.parametrize("name, tol", [("ddp", FP32_TOL), ("hsdp", FP32_TOL), ("fs_tp2", 1e-5)])
def test_strategies_train_alike(four, name, tol):
    """FSDP2 full_shard, HSDP (2 x 2 mesh), DDP and FSDP x TP (2 data-parallel x 2 tensor-parallel ranks): the same
    model, data and AdamW: the same losses."""
    np.testing.assert_allclose(losses(four, name), losses(four, "fs"), rtol=0, atol=tol)
    assert four[name]["val_loss"]["10"] == pytest.approx(four["fs"]["val_loss"]["10"], abs=tol)


def test_bf16_with_recompute_tracks_fp32(four):
    curve, reference = losses(four, "fs_bf16_recompute"), losses(four, "fs")
    np.testing.assert_allclose(curve, reference, rtol=0, atol=BF16_TOL)
    assert np.abs(curve - reference).max() > 1e-6  # really bf16


def test_resume_equals_uninterrupted(four):
    """Stopped by a flag on the last rank only (acted on one step later, at 4), saved, resumed: exactly the same."""
    assert len(four["fs_stopped"]["wall_s"]) == 2
    np.testing.assert_array_equal(losses(four, "fs_stopped"), losses(four, "fs"))
    np.testing.assert_array_equal(four["fs_stopped"]["lr"], four["fs"]["lr"])


def test_rank_count_does_not_change_the_losses(four, two):
    np.testing.assert_allclose(losses(two, "fs2"), losses(four, "fs"), rtol=0, atol=FP32_TOL)


@pytest.mark.parametrize("name", ["fs2_from_4", "ddp2_from_4", "fs2_from_async"])
def test_checkpoint_reshards_on_load(four, two, name):
    """Saved by 4 FSDP ranks at step 5 (also in the background: checkpoint.async_save), resumed by 2 ranks (FSDP, and
    DDP): steps 6..10 as the uninterrupted run."""
    np.testing.assert_allclose(losses(two, name, first=6), losses(four, "fs")[5:], rtol=0, atol=FP32_TOL)


def test_async_save_changes_nothing_and_completes(four):
    """The background write of step 5 overlaps steps 6.. and captures step 5's state: the same losses, and both
    checkpoints complete and verified in the end (the last one written synchronously)."""
    from pathlib import Path

    from hpc_tools.checkpoints.dirs import CheckpointDirs
    from hpc_tools.checkpoints.verify import verify_share

    np.testing.assert_array_equal(losses(four, "fs_async"), losses(four, "fs"))
    dirs = CheckpointDirs(Path(four["fs_async"]["run_dir"]) / "checkpoints")
    assert [s for s, _ in dirs.complete()] == [5, 10] and not list(dirs.root.glob("*.partial"))
    for _, path in dirs.complete():
        assert verify_share(path, CheckpointDirs.read_meta(path), 0, 1, checksum=True).problems == []


def test_checkpoints_are_verified_dcp_folders(four):
    from pathlib import Path

    from hpc_tools.checkpoints.dirs import CheckpointDirs

    dirs = CheckpointDirs(Path(four["hsdp"]["run_dir"]) / "checkpoints")
    assert [s for s, _ in dirs.complete()] == [5, 10]
    newest = dirs.newest()
    meta = CheckpointDirs.read_meta(newest)
    assert meta["format"] == "torch_dcp" and meta["mesh"] == [2, 2] and meta["step"] == 10
    assert (newest / "dcp" / ".metadata").is_file()
    recorded = {name for entries in meta["files"]["by_rank"].values() for name in entries}
    assert {f"dcp/__{r}_0.distcp" for r in range(4)} <= recorded, recorded


@pytest.mark.parametrize("name", ["fs", "gpt_fs", "fs_tp2"])
def test_export_matches_the_runs_validation_loss(four, name, tmp_path):
    """``export`` -> HF folder; its loss on the run's validation batches is the val_loss the run recorded."""
    import torch
    from transformers import AutoModelForCausalLM

    from hpc_tools.hf.export import export_run, run_recipe
    from hpc_tools.layout import ParallelLayout
    from hpc_tools.registry import RunFolder
    from hpc_tools.train.data import microbatches_for_step, validation_samples
    from hpc_tools.train.hf_causal_lm import causal_lm_loss

    run_dir = four[name]["run_dir"]
    summary = export_run(run_dir, tmp_path / "hf")
    assert summary["step"] == STEPS
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    recipe = run_recipe(RunFolder(run_dir))
    layout, samples = ParallelLayout.from_recipe(recipe), validation_samples(recipe)
    total, count = 0.0, 0
    with torch.no_grad():
        for i in (1, 2):
            for rank in range(layout.data_size):
                for mb in microbatches_for_step(samples, i, rank, layout):
                    total += float(causal_lm_loss(model(input_ids=mb["tokens"]).logits, mb["labels"]))
                    count += 1
    assert total / count == pytest.approx(four[name]["val_loss"]["10"], abs=1e-5)


@pytest.mark.megatron
@pytest.mark.parametrize("name", ["hf_ddp", "hf_megatron"])
def test_one_model_three_backends(two, name):
    """The same HF folder, fp32: FSDP2, DDP and Megatron-core TP1 PP1 train to the same losses over 20 steps."""
    reference = losses(two, "hf_fsdp", last=EQUIVALENCE_STEPS)
    np.testing.assert_allclose(losses(two, name, last=EQUIVALENCE_STEPS), reference, rtol=0, atol=CROSS_BACKEND_TOL)
    assert reference[-1] < reference[0] - 0.3  # and it trained
