"""GPU tier of issue 12 (skipped without CUDA): the fast path really runs, and the checkpoint contract holds on GPU.

- a real-shape single-GPU run (gpt_3d's 1.3B model, seq 2048, TP1; benchmarks/gpu_mfu.py): Transformer Engine with
  its own choice of attention (flash or cuDNN fused) in use, step time, tok/s, MFU (Megatron convention) and peak
  memory printed next to the planner's prediction, and an MFU floor;
- resume on GPU in bf16 and fp32 with megatron-core's real optimizer (TE's FusedAdam when TE imports), and with 2
  GPUs the overlap_param_gather save (saved weights = gathered weights) and resume
  (tests/integration/megatron_gpu_path_driver.py --device cuda);
- multi-rank TP / PP / SP over NCCL when >= 2 GPUs: tests/integration/test_megatron_gpu.py.

The CPU-runnable parts (argument parsing, the recipe, the layer plan, the prediction) are exercised on CPU by
tests/unit/test_gpu_tier_cpu.py.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, run_driver

torch = pytest.importorskip("torch")

HERE = Path(__file__).resolve().parent
MFU_FLOOR = 0.35
"""Below this the fast path is not running (the goal is >= 0.50 on one H100; the planner predicts 0.60)."""
GPU_LOSS_ATOL = 1e-3
"""A GPU resume need not be bit-identical (non-deterministic reductions); one step of lr 2e-3 moves the loss ~3e-2."""
GPU_WEIGHT_ATOL = 1e-4
"""Stale weights differ by about one update (~2e-3); gathered ones by reduction-order noise at most."""

pytestmark = [pytest.mark.gpu, pytest.mark.megatron,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              # the fast path is Transformer Engine's: without it every case here is refused at build (as it should
              # be); benchmarks/gpu_smoke.sh then runs local layers (megatron_save/resume, gpu_mfu_local) instead
              pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                                 reason="needs Transformer Engine")]


def test_real_shape_single_gpu_mfu(tmp_path):
    out = tmp_path / "mfu.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_mfu.py"), "--size", "1.3b", "--seq", "2048",
                           "--steps", "10", "--json", str(out), "--min-mfu", str(MFU_FLOOR)],
                          capture_output=True, text=True, timeout=1800)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    measured = json.loads(out.read_text())["measured"]
    # TE's own choice (issue 25), named by the attention paths (issue 43)
    assert "layers=transformer_engine, attention=te-flash|te-fused" in measured["layer_plan"]
    assert measured["attention"].startswith(("te-flash", "te-fused")), measured["attention"]
    assert measured["mfu"] >= MFU_FLOOR
    assert measured["losses"][-1] < measured["losses"][0]


@pytest.fixture(scope="module")
def gpu_path(tmp_path_factory) -> dict:
    return run_driver("megatron_gpu_path_driver.py", tmp_path_factory.mktemp("gpu_path") / "results.json",
                      "--device", "cuda", timeout=1200)


def test_resume_on_gpu(gpu_path):
    assert gpu_path["device"] == "cuda"
    for name in ("te distributed bf16", "te plain fp32"):
        r = gpu_path[name]
        assert r["group_steps_after_load"] in ([2], [])  # TE: an int per group; torch: per parameter
        assert r["resumed"] == pytest.approx(r["straight"], abs=GPU_LOSS_ATOL), name
        if "transformer_engine" in r["plan"]:
            # fp32 ran at all (issue 25 item 1: a pinned flash/fused backend left TE none for fp32 inputs), on TE's
            # unfused attention; bf16 on a flash-style one
            assert "attention=" + ("te-flash|te-fused" if "bf16" in name else "unfused") in r["plan"], r["plan"]
            fast = ("te-flash", "te-fused") if "bf16" in name else ("unfused",)
            assert (r["te_attention"] or "").startswith(fast), (name, r["te_attention"])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="overlap_param_gather needs 2 data-parallel GPUs")
def test_overlap_param_gather_save_and_resume_on_gpu(gpu_path):
    r = gpu_path["overlap"]
    for rank in r["per_rank"]:
        assert rank["saved_vs_gathered"] <= GPU_WEIGHT_ATOL
    assert r["resumed"] == pytest.approx(r["straight"], abs=GPU_LOSS_ATOL)
