"""GPU tier: the Hugging Face backends' fused kernels (``backend.<kind>.liger``, ``backend.fsdp.compile``) train the
plain path's losses on the local GPUs (nccl), through the real rank path (``hpc_tools.testing.matrix``): Liger's
RMSNorm, SwiGLU, RoPE and fused linear cross entropy in fp32 (equal to the plain fp32 losses up to the kernels' own
reduction order) and in bf16 (tracking the plain bf16 curve), Liger under compiled blocks, and Liger under DeepSpeed
and Horovod's model code (DeepSpeed ZeRO-1: fused loss; ZeRO-3: kernels without it). Skipped without CUDA or without
liger-kernel (environment/requirements-gpu.txt; benchmarks/gpu_smoke.sh carries its wheel)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

STEPS = 8


def variant(name, kind="fsdp", *, precision="bf16", liger=False, **options):
    return {"name": name, "recipe": {
        "name": name,
        "model": {"family": "llama", "num_layers": 4, "hidden_size": 256, "num_attention_heads": 8,
                  "num_query_groups": 4, "ffn_hidden_size": 688, "seq_length": 256, "vocab_size": 512},
        "training": {"micro_batch_size": 4, "global_batch_size": 8, "train_iters": STEPS, "lr": 2e-3,
                     "min_lr": 2e-4, "lr_warmup_iters": 2, "precision": precision},
        "backend": {"kind": kind, kind: {"liger": liger, **options}},
        "checkpoint": {"interval_iters": 0},
        "cluster": {"nodes": 1, "gpus_per_node": 1, "gpu_type": "H100-SXM", "hang_timeout_min": 5}}}


def test_liger_and_compile_train_the_plain_losses(tmp_path):
    pytest.importorskip("liger_kernel")
    from hpc_tools.testing.matrix import launch

    variants = [variant("plain_fp32", precision="fp32"), variant("liger_fp32", precision="fp32", liger=True),
                variant("plain_bf16"), variant("liger_bf16", liger=True),
                variant("liger_compiled_bf16", liger=True, compile=True),
                variant("ds1_liger_bf16", "deepspeed", liger=True, zero_stage=1),
                variant("ds3_liger_bf16", "deepspeed", liger=True, zero_stage=3)]
    results = launch(variants, 1, tmp_path, backend="nccl")
    loss = {name: np.asarray(r["loss"], dtype=float) for name, r in results.items()}
    for name, curve in loss.items():
        assert len(curve) == STEPS and np.isfinite(curve).all() and curve[-1] < curve[0] - 0.3, (name, curve)
    # fp32: Liger's kernels compute what the plain layers compute, in another order
    np.testing.assert_allclose(loss["liger_fp32"], loss["plain_fp32"], rtol=2e-4)
    for name in ("liger_bf16", "liger_compiled_bf16", "ds1_liger_bf16", "ds3_liger_bf16"):
        assert np.abs(loss[name] - loss["plain_bf16"]).max() < 0.05, (name, loss[name], loss["plain_bf16"])
