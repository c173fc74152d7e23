"""Megatron <-> Hugging Face in ONE launch of 4 gloo ranks (tests/integration/test_hf_export.py asserts).

    python tests/integration/hf_export_driver.py --work DIR

Without RANK in the environment it writes, in DIR, a random tiny Hugging Face model per family (``hf_gpt``,
``hf_llama``, ``hf_mixtral``: GPT2LMHeadModel, LlamaForCausalLM with grouped-query attention and MixtralForCausalLM
with 4 experts, top-2, every weight random, norms and biases included) and a fixed token batch (``tokens.pt``), then
starts 4 copies of itself (``hpc_tools.testing.spawn``). Each rank then, for every family and each of its layouts
(FAMILY_LAYOUTS), in one
torch.distributed world:

1. creates (rank 0) a run folder ``runs/<case>`` whose recipe sets ``checkpoint.init_from_hf`` to the family's folder;
2. builds the Megatron trainer's job (``MegatronJob``: the engine of the layout, initialised from the folder by
   its ``init_from_hf`` hook), saves the step-0 checkpoint (model only) and records the Megatron logits of the batch;
3. trains STEPS steps, saves a full checkpoint, records the logits again, and checks that ``init_unless_resuming``
   now declines (a checkpoint to resume exists).

Logits go to ``runs/<case>/logits_step<N>.pt`` (full vocabulary, gathered over tensor-parallel ranks, from the last
pipeline stage), and ``results.json`` lists the cases.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import _checkout  # noqa: F401  (this checkout on sys.path, before any hpc_tools import)

WORLD = 4
STEPS = 2
VOCAB = 500  # not a multiple of 128: the padded vocabulary rows are exercised
BATCH = 2  # sequences in the fixed batch (one per microbatch)

BASE = {
    "name": "hf_export",
    "model": {"family": "gpt", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
              "vocab_size": VOCAB},
    "parallel": {"tensor_size": 1, "pipeline_size": 1, "data_size": -1, "virtual_pipeline_size": None},
    "training": {"micro_batch_size": 1, "global_batch_size": 8, "train_iters": STEPS, "lr": 2e-3, "min_lr": 2e-4,
                 "lr_warmup_iters": 1, "precision": "fp32", "seed": 1234},
    "backend": {"kind": "megatron", "megatron": {"distributed_optimizer": True}},
    "data": {"source": "synthetic"},
    "cluster": {"nodes": 1, "gpus_per_node": WORLD, "gpu_type": "cpu", "cpus_per_task": 1},
}
FAMILIES = {"gpt": {}, "llama": {"model": {"family": "llama", "num_query_groups": 2, "ffn_hidden_size": 160}},
            "mixtral": {"model": {"family": "llama", "num_query_groups": 2, "ffn_hidden_size": 96, "num_experts": 4,
                                  "moe_router_topk": 2}}}
LAYOUTS = {
    "tp1pp1": [],
    "tp2pp2": ["parallel.tensor_size=2", "parallel.pipeline_size=2"],
    "pp2vpp2": ["parallel.pipeline_size=2", "parallel.virtual_pipeline_size=2"],
    "ep2tp2": ["parallel.expert_size=2", "parallel.tensor_size=2", "parallel.sequence_parallel=true"],
}
FAMILY_LAYOUTS = {"gpt": ("tp1pp1", "tp2pp2", "pp2vpp2"), "llama": ("tp1pp1", "tp2pp2", "pp2vpp2"),
                  "mixtral": ("tp1pp1", "ep2tp2")}
"""Mixtral (a Megatron MoE): DP4 with every expert on each rank, and EP2 x TP2 (+SP, which MoE with TP needs)."""
CASES = [f"{fam}-{lay}" for fam in FAMILIES for lay in FAMILY_LAYOUTS[fam]]


def make_recipe(case: str, work: Path):
    from hpc_tools.recipe.load import deep_merge, resolve

    fam, lay = case.split("-")
    sets = LAYOUTS[lay] + [f"checkpoint.init_from_hf={work / f'hf_{fam}'}"]
    return resolve(deep_merge(BASE, FAMILIES[fam]), sets, source="hf_export_driver")


def prepare(work: Path) -> None:
    """The families' random Hugging Face folders and the fixed token batch."""
    import torch
    from transformers import AutoModelForCausalLM

    from hpc_tools.hf.config import hf_config
    from hpc_tools.recipe.load import deep_merge, resolve

    for i, fam in enumerate(FAMILIES):
        torch.manual_seed(100 + i)
        model = AutoModelForCausalLM.from_config(hf_config(resolve(deep_merge(BASE, FAMILIES[fam]))),
                                                 dtype=torch.float32)
        with torch.no_grad():  # norms start at 1 and biases at 0: make every weight count
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        model.save_pretrained(str(work / f"hf_{fam}"))
    gen = torch.Generator().manual_seed(7)
    torch.save(torch.randint(0, VOCAB, (BATCH, BASE["model"]["seq_length"]), generator=gen), work / "tokens.pt")


def megatron_logits(engine, tokens):
    """Logits of ``tokens`` (one sequence per microbatch) through the layout's pipeline schedule, gathered over the
    tensor-parallel ranks; a [BATCH, seq, padded vocab] tensor on the last stage, None elsewhere."""
    import torch
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    batches = [{"tokens": tokens[i:i + 1], "position_ids": positions} for i in range(tokens.shape[0])]

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        output = model(b["tokens"], b["position_ids"], None)

        def loss_func(out):
            return out.sum() * 0.0, {"logits": gather_from_tensor_model_parallel_region(out).detach().clone()}

        return output, loss_func

    chunks = engine.chunks
    with torch.no_grad():
        stored = engine.forward_backward(
            forward_step_func=forward_step, data_iterator=[iter(batches) for _ in chunks] if len(chunks) > 1
            else iter(batches), model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=len(batches),
            seq_length=tokens.shape[1], micro_batch_size=1, forward_only=True)
    return torch.cat([d["logits"] for d in stored]) if engine.coords.is_last_stage else None


def rank_main(work: Path) -> None:
    import torch
    import torch.distributed as dist

    from hpc_tools.layout import ParallelLayout
    from hpc_tools.recipe.load import dump_resolved
    from hpc_tools.registry import RunFolder
    from hpc_tools.runtime.context import RankContext
    from hpc_tools.runtime.distenv import DistEnv
    from hpc_tools.train.checkpointing.saver import save_once
    from hpc_tools.train.megatron.hf_import import init_unless_resuming
    from hpc_tools.train.megatron.trainer import MegatronJob, _quiet_megatron

    _quiet_megatron()
    from hpc_tools.runtime.distenv import join_world

    join_world("gloo")
    tokens = torch.load(work / "tokens.pt")
    results = {}
    for case in CASES:
        t0 = time.perf_counter()
        recipe = make_recipe(case, work)
        layout = ParallelLayout.from_recipe(recipe)
        run = RunFolder(work / "runs" / case)
        if dist.get_rank() == 0:
            RunFolder.create(work / "runs", case, dump_resolved(recipe), "#!/bin/sh\n", {"backend": "megatron"})
        dist.barrier()
        # The Megatron trainer's own constructor: it builds the engine and applies checkpoint.init_from_hf.
        job = MegatronJob(RankContext(recipe=recipe, layout=layout, dist=DistEnv.from_environ(), run=run))
        engine, dirs = job.engine, job.dirs
        save_once(job, dirs, 0)  # before any optimizer step: the model only
        logits = {0: megatron_logits(engine, tokens)}
        losses = [job.step(step, job.batch(step)).loss for step in range(1, STEPS + 1)]
        save_once(job, dirs, STEPS)
        logits[STEPS] = megatron_logits(engine, tokens)
        declined = not init_unless_resuming(engine, recipe, dirs)
        c = engine.coords
        if c.is_last_stage and c.tp_rank == 0 and c.dp_rank == 0:
            for step, value in logits.items():
                torch.save(value, run.path / f"logits_step{step}.pt")
        job.close()
        dist.barrier()
        results[case] = {"run": str(run.path), "layout": layout.describe(), "losses": losses,
                         "declined_on_resume": declined, "seconds": time.perf_counter() - t0}
    if dist.get_rank() == 0:
        (work / "results.json").write_text(json.dumps(results, indent=2))
    dist.barrier()
    dist.destroy_process_group()


def launch(work: Path, timeout_s: float = 600) -> int:
    """Prepare ``work`` and run WORLD ranks of this script; returns the first non-zero exit code (124: timed out)."""
    from hpc_tools.testing.spawn import spawn_exit_code

    prepare(work)
    return spawn_exit_code([sys.executable, __file__, "--work", str(work)], WORLD, timeout_s=timeout_s,
                           env={"PYTHONWARNINGS": "ignore"})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="folder for the HF models, runs and results")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        args.work.mkdir(parents=True, exist_ok=True)
        return launch(args.work)
    rank_main(args.work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
