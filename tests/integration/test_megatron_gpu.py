"""GPU tier: the Megatron backend in bf16 over NCCL on this node's GPUs (skipped without CUDA).

The gpt_3d local profile scaled to the GPUs present (TP2 when there are 2, TP2 x PP2 with 4 or more), through the real
entry point (run folder -> local executor -> one rank per GPU). Checks the CPU compatibility layer stays off, the
loss falls and every rank writes its records.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers import REPO

torch = pytest.importorskip("torch")


pytestmark = [pytest.mark.gpu, pytest.mark.megatron,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_bf16_nccl_on_local_gpus(tmp_path):
    from hpc_tools.executors.local import run_local
    from hpc_tools.layout import ParallelLayout
    from hpc_tools.recipe.load import load_recipe
    from hpc_tools.submission import new_run

    gpus = torch.cuda.device_count()
    world = 4 if gpus >= 4 else min(gpus, 2)
    tp, pp = (2, 2) if world == 4 else (world, 1)
    recipe = load_recipe(REPO / "recipes" / "gpt_3d.yaml", profile="local", overrides=[
        "cluster.gpu_type=H100-SXM", f"cluster.gpus_per_node={world}", "training.precision=bf16",
        f"parallel.tensor_size={tp}", f"parallel.pipeline_size={pp}",
        f"parallel.sequence_parallel={'true' if tp > 1 else 'false'}",
        "training.train_iters=20", "checkpoint.interval_iters=10", "model.hidden_size=256", "model.seq_length=256"])
    run = new_run(recipe, tmp_path / "runs", "local", source="gpu-test")
    code = run_local(run, ParallelLayout.from_recipe(recipe).world_size)
    log0 = (run.logs_dir / "rank00000.out").read_text()
    assert code == 0, log0[-3000:]
    assert run.manifest()["state"] == "COMPLETED"
    assert "cpu_compat" not in log0, "the CPU compatibility layer must never be active with CUDA"
    assert "on cuda" in log0
    losses = {}
    for rank in range(world):
        records = [json.loads(x) for x in (run.records_dir / f"rank{rank:05d}.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == list(range(1, 21))
        losses.update({r["step"]: r["loss"] for r in records if r["loss"] is not None})
    assert losses[20] < losses[1] - 0.3, losses
