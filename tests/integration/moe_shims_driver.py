"""Megatron-core's MoE and MLA code on a CPU-only torch, with and without each CPU shim (one gloo rank).

    python tests/integration/moe_shims_driver.py --out results.json

Installs ``cpu_compat``, then trains one step of a tiny MoE GPT (``alltoall`` dispatcher, fp32 router) and of a tiny
MLA + MoE GPT through ``MegatronCore``, and passes ``all_to_all_single`` the split sizes the dispatcher makes. Then, for
each shim in turn, puts megatron-core's (or torch's) original back, runs the same thing again, records the error it
raises, and reinstalls the shim. Writes ``{"with": {...}, "without": {shim: "Error: message"}}`` as JSON;
tests/integration/test_megatron_moe.py asserts on it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import _checkout  # noqa: F401  (this checkout on sys.path, before any hpc_tools import)

MOE = {
    "name": "moe_shims",
    "model": {"family": "gpt", "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16,
              "vocab_size": 512, "ffn_hidden_size": 64, "add_bias_linear": False, "num_experts": 4},
    "training": {"micro_batch_size": 1, "global_batch_size": 2, "train_iters": 1, "precision": "fp32"},
    "backend": {"kind": "megatron", "megatron": {"distributed_optimizer": False}},
    "data": {"source": "synthetic"},
    "cluster": {"nodes": 1, "gpus_per_node": 1, "gpu_type": "cpu", "cpus_per_task": 1},
}
MLA = ["model.family=llama", "model.multi_latent_attention=true", "model.q_lora_rank=16", "model.kv_lora_rank=16",
       "model.qk_head_dim=8", "model.qk_pos_emb_head_dim=4", "model.v_head_dim=8"]


def train_one_step(sets: list[str]) -> float:
    from hpc_tools.layout import ParallelLayout
    from hpc_tools.recipe.load import resolve
    from hpc_tools.train.data import build_samples, microbatches_for_step
    from hpc_tools.train.megatron.engine import MegatronCore

    recipe = resolve(MOE, sets, source="moe_shims_driver")
    layout = ParallelLayout.from_recipe(recipe)
    engine = MegatronCore(recipe, layout, "cpu")
    try:
        return engine.train_step(1, microbatches_for_step(build_samples(recipe), 1, 0, layout)).loss
    finally:
        engine.close()


def exchange_splits() -> list[float]:
    """What the dispatcher does with its split sizes: DtoH (a no-op on CPU), then gloo's all_to_all_single."""
    import torch
    import torch.distributed as dist
    from megatron.core.transformer.moe import token_dispatcher

    splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3]), as_numpy=True)
    out = torch.empty(3)
    dist.all_to_all_single(out, torch.arange(3.0), output_split_sizes=splits, input_split_sizes=splits)
    return out.tolist()


def checks() -> dict:
    return {"moe": lambda: train_one_step([]), "mla": lambda: train_one_step(MLA), "splits": exchange_splits}


def error(fn) -> str | None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - recorded for the test to judge
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import torch
    import torch.distributed as dist

    from hpc_tools.train.megatron import cpu_compat
    from hpc_tools.train.megatron.trainer import _quiet_megatron

    _quiet_megatron()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    from hpc_tools.runtime.distenv import free_port

    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    cuda = {name: getattr(torch.cuda, name) for name in ("Stream", "current_stream", "stream")}
    cpu_compat.install()
    from megatron.core.transformer import dot_product_attention as dpa
    from megatron.core.transformer import multi_latent_attention as mla
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    run = checks()
    results: dict = {"with": {name: fn() for name, fn in run.items()}, "without": {}}

    def undo_streams():
        saved = {name: getattr(torch.cuda, name) for name in cuda}
        for name, fn in cuda.items():
            setattr(torch.cuda, name, fn)
        token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = None  # built once per process

        def redo():
            for name, fn in saved.items():
                setattr(torch.cuda, name, fn)
            token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = None
        return redo

    def undo_te_general_gemm():  # not a shim any more: the model builder binds it on every device (bind_router_gemm)
        del moe_utils.te_general_gemm
        return lambda: setattr(moe_utils, "te_general_gemm", None)

    def undo_splits():
        shim = token_dispatcher.maybe_move_tensor_to_cpu
        token_dispatcher.maybe_move_tensor_to_cpu = shim.__wrapped__
        return lambda: setattr(token_dispatcher, "maybe_move_tensor_to_cpu", shim)

    def undo_mla_have_te():
        mla.HAVE_TE = True
        return lambda: setattr(mla, "HAVE_TE", False)

    def undo_mla_channels():
        shim = dpa.DotProductAttention.__init__
        dpa.DotProductAttention.__init__ = shim.__wrapped__
        return lambda: setattr(dpa.DotProductAttention, "__init__", shim)

    for name, undo, check in (("streams", undo_streams, "moe"), ("te_general_gemm", undo_te_general_gemm, "moe"),
                              ("splits", undo_splits, "splits"), ("mla_have_te", undo_mla_have_te, "mla"),
                              ("mla_channels", undo_mla_channels, "mla")):
        redo = undo()
        try:
            results["without"][name] = error(run[check])
        finally:
            redo()
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
    args.out.write_text(json.dumps(results, indent=2))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
