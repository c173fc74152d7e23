"""The CPU-runnable parts of the GPU tier: benchmarks/gpu_mfu.py's arguments, recipe, layer plan and prediction, and
that the GPU tier's test module and driver import on a machine without CUDA."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_mfu_builds_the_real_shape_recipe_and_the_fast_path_plan():
    mfu = load(REPO / "benchmarks" / "gpu_mfu.py", "gpu_mfu")
    args = mfu.parse_args(["--size", "1.3b", "--micro-batch", "4", "--accum", "8"])
    recipe = mfu.build_recipe(args, "H100-SXM")
    m, lay = recipe.model, recipe.parallel
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length) == (24, 2048, 16, 2048)
    assert (lay.tensor_size, lay.pipeline_size) == (1, 1) and recipe.training.global_batch_size == 32
    from hpc_tools.train.megatron.layers import layer_plan

    plan = layer_plan(recipe, "cuda", te_available=True)
    assert plan.attention == "auto" and plan.flash_style  # bf16: TE's choice, named as its two paths
    assert plan.describe() == "layers=transformer_engine, attention=te-flash|te-fused"
    # gpt_3d's 4.44e15 FLOPs per 256-sequence step, Megatron convention, per 32 sequences
    assert abs(mfu.model_flops(recipe) - 4.44e15 / 8) / 5.55e14 < 0.01
    predicted = mfu.prediction(recipe)
    assert 0 < predicted["step_s"] and 0 < predicted["mfu"] <= 1 and predicted["memory_gb"] < 80


def test_gpu_mfu_dry_run_prints_the_convention_and_the_prediction():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_mfu.py"), "--dry-run", "--size", "2.7b"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "MFU convention: Megatron (profiling/flops.py)" in proc.stdout
    assert "predicted: step" in proc.stdout and "32 layers x 2560" in proc.stdout


def test_gpu_tier_modules_import_without_cuda():
    sys.path.insert(0, str(REPO / "tests" / "integration"))
    try:
        driver = load(REPO / "tests" / "integration" / "megatron_gpu_path_driver.py", "gpu_path_driver")
        tier = load(REPO / "tests" / "integration" / "test_gpu_tier.py", "gpu_tier")
    finally:
        sys.path.remove(str(REPO / "tests" / "integration"))
    assert driver.world_for("cpu") == 2 and "te distributed bf16" in driver.TE_CASES
    assert 0 < tier.MFU_FLOOR < 0.5
