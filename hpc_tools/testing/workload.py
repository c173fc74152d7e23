"""Small real multi-rank jobs (torch.distributed gloo) that drive the collectors, for their tests and the overhead
benchmark: ``python -m hpc_tools.testing.workload SCENARIO --out DIR`` on every rank (started by ``launch``).

Scenarios, each writing ``DIR/result_rank<R>.json``:

* ``comm``: a data-parallel MLP whose step issues every collective kind Megatron and DeepSpeed use (sync and async
  all-reduce, a coalesced block, all-gather / reduce-scatter into tensors, broadcast, isend/irecv, batch_isend_irecv)
  with known sizes; then a second collector on the same records (a requeue, restart=1) continues the steps.
* ``pipeline``: megatron.core's own 1F1B schedule (``get_forward_backward_func``) over 2 pipeline stages of a small
  MLP, once per microbatch count in ``--microbatches``; each in its own run folder.
* ``bench``: the same data-parallel job with the collectors off, with the default set, and with everything on,
  interleaved in rounds; the step times are taken by the workload itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from hpc_tools.testing.spawn import spawn_ranks

HIDDEN = 256


def make_ctx(run_dir: Path, world: int, profiling: dict[str, Any], *, pipeline: int = 1, micro: int = 4,
             global_batch: int | None = None, restart: int = 0):
    """A real RankContext for a tiny recipe (CPU ranks) whose records go to ``run_dir/records``."""
    from hpc_tools.layout import ParallelLayout
    from hpc_tools.recipe.load import resolve
    from hpc_tools.registry import RunFolder
    from hpc_tools.runtime.context import RankContext
    from hpc_tools.runtime.distenv import DistEnv

    raw = {"name": "profiling-workload",
           "model": {"num_layers": 2, "hidden_size": HIDDEN, "num_attention_heads": 4, "seq_length": 16,
                     "vocab_size": 512},
           "parallel": {"pipeline_size": pipeline},
           "training": {"micro_batch_size": micro, "global_batch_size": global_batch or micro * world // pipeline,
                        "precision": "fp32"},
           "backend": {"kind": "deepspeed"},
           "cluster": {"nodes": 1, "gpus_per_node": world, "gpu_type": "cpu", "gpu_peak_tflops": 1.0},
           "profiling": profiling}
    recipe = resolve(raw, check=False)
    (run_dir / "records").mkdir(parents=True, exist_ok=True)
    dist_env = dataclasses.replace(DistEnv.from_environ(), restart_count=restart)
    return RankContext(recipe=recipe, layout=ParallelLayout.from_recipe(recipe), dist=dist_env, run=RunFolder(run_dir))


class _DPJob:
    """A data-parallel MLP step: forward, backward, one all-reduce of the flattened gradients, SGD."""

    def __init__(self, extra_collectives: bool, rows: int = 64):
        import torch

        torch.manual_seed(0)
        self.model = torch.nn.Sequential(*[torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(4)])
        self.x = torch.randn(rows, HIDDEN)
        self.extra = extra_collectives
        self.grad_bytes = sum(p.numel() for p in self.model.parameters()) * 4

    def step(self) -> float:
        import torch
        import torch.distributed as dist

        loss = self.model(self.x).pow(2).mean()
        self.model.zero_grad(set_to_none=True)
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in self.model.parameters()])
        dist.all_reduce(flat)
        if self.extra:
            self._collectives()
        with torch.no_grad():
            offset = 0
            for p in self.model.parameters():
                p -= 1e-3 * flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
        return float(loss)

    def _collectives(self) -> None:
        """Every kind, with sizes the test checks (float32: 4 bytes each)."""
        import torch
        import torch.distributed as dist

        n, rank = dist.get_world_size(), dist.get_rank()
        work = dist.all_reduce(torch.ones(1000), async_op=True)                     # all_reduce 4000
        work.wait()
        with dist._coalescing_manager(async_ops=True) as cm:                           # all_reduce 2 x 400, one op
            dist.all_reduce(torch.ones(100))
            dist.all_reduce(torch.ones(100))
        cm.wait()
        dist.all_gather_into_tensor(torch.empty(256 * n), torch.ones(256))            # all_gather 1024 n
        dist.reduce_scatter_tensor(torch.empty(256), torch.ones(256 * n))            # reduce_scatter 1024 n
        dist.broadcast(torch.ones(128), src=0)                                         # broadcast 512
        peer = (rank + 1) % n if rank % 2 == 0 else (rank - 1) % n
        buf = torch.ones(64)
        req = dist.isend(buf, peer) if rank % 2 == 0 else dist.irecv(buf, peer)       # p2p 256
        req.wait()
        ops = [dist.P2POp(dist.isend, torch.ones(32), peer), dist.P2POp(dist.irecv, torch.empty(32), peer)]
        for r in dist.batch_isend_irecv(ops if rank % 2 == 0 else ops[::-1]):         # p2p 256
            r.wait()


def scenario_comm(out: Path, steps: int, interval: int) -> dict[str, Any]:
    from profiling.collector import StepCollector

    world = int(os.environ["WORLD_SIZE"])
    job = _DPJob(extra_collectives=True)
    result = {"grad_bytes": job.grad_bytes, "world": world}
    profiling = {"communication_sample_interval": interval, "summary_interval": 2, "warmup_steps": 1,
                 "torch_profiler": {"enabled": True, "start_step": 2, "num_steps": 2, "ranks": [0]}}
    for restart, first, last in ((0, 1, steps), (1, steps + 1, steps + 2)):  # a requeue continues the steps
        ctx = make_ctx(out / "run", world, profiling, restart=restart)
        collector = StepCollector.for_rank(ctx, dp_rank=ctx.rank)
        for step in range(first, last + 1):
            collector.start_step(step)
            with collector.data_timer():
                time.sleep(0.002)
            loss = job.step()
            collector.end_step(step, loss=loss, lr=1e-3)
        collector.close()
    return result


class _PipelineJob:
    """Megatron-core's 1F1B schedule over ``WORLD_SIZE`` stages of a 4-layer MLP each; ``step()`` runs one global
    batch of ``microbatches``. Each microbatch's compute (~0.8 GFLOP fwd+bwd per stage) dwarfs OS scheduling noise."""

    seq, micro, hidden = 16, 8, 512

    def __init__(self):
        import torch
        from megatron.core import parallel_state
        from megatron.core.enums import ModelType
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.transformer import TransformerConfig

        from hpc_tools.train.megatron import cpu_compat

        cpu_compat.install()
        self.world = int(os.environ["WORLD_SIZE"])
        parallel_state.initialize_model_parallel(pipeline_model_parallel_size=self.world)
        self.stage = parallel_state.get_pipeline_model_parallel_rank()
        hidden = self.hidden
        config = TransformerConfig(num_layers=self.world, hidden_size=hidden, num_attention_heads=4,
                                   pipeline_model_parallel_size=self.world, pipeline_dtype=torch.float32,
                                   batch_p2p_comm=False, deallocate_pipeline_outputs=False)

        class Stage(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.config = config
                self.model_type = ModelType.encoder_or_decoder
                self.layers = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(4)])
                self.input_tensor = None

            def set_input_tensor(self, tensor):
                self.input_tensor = tensor[0] if isinstance(tensor, list) else tensor

            def forward(self, x):
                return self.layers(x if self.input_tensor is None else self.input_tensor)

        torch.manual_seed(self.stage)
        self.model = Stage()
        self.fb = get_forward_backward_func()
        self._torch = torch
        self.inputs: list = []

    @staticmethod
    def _forward_step(data_iterator, module):
        out = module(next(data_iterator))

        def loss_func(output):
            loss = output.pow(2).mean()
            return loss, {"loss": loss.detach().clone()}

        return out, loss_func

    def step(self, microbatches: int) -> None:
        while len(self.inputs) < microbatches:  # made once, outside the timed steps, and reused
            self.inputs.append(self._torch.randn(self.seq, self.micro, self.hidden))
        data = iter(self.inputs[:microbatches])
        self.fb(forward_step_func=self._forward_step, data_iterator=data, model=[self.model],
                num_microbatches=microbatches, seq_length=self.seq, micro_batch_size=self.micro, forward_only=False)

    def close(self) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state

        dist.barrier()
        parallel_state.destroy_model_parallel()


def scenario_pipeline(out: Path, steps: int, microbatches: list[int]) -> dict[str, Any]:
    """Megatron-core's 1F1B schedule over 2 stages; returns each configuration's measured bubble share."""
    from profiling.collector import StepCollector

    job = _PipelineJob()
    result: dict[str, Any] = {"stage": job.stage, "bubble": {}, "theory": {}}
    for m in microbatches:
        ctx = make_ctx(out / f"m{m}", job.world, {"communication": False, "warmup_steps": 1,
                                                  "summary_interval": steps},
                       pipeline=job.world, micro=job.micro, global_batch=job.micro * m)
        collector = StepCollector.for_rank(ctx, pp_rank=job.stage, dp_rank=0)
        for step in range(1, steps + 1):
            collector.start_step(step)
            job.step(m)
            collector.end_step(step)
        collector.close()
        summary = collector.summary_dict()
        result["bubble"][m] = summary["bubble_share"]
        result["theory"][m] = ctx.layout.bubble_fraction
    job.close()
    return result


BENCH_CONFIGS = {
    "off": {"enabled": False},
    "default": {},
    "everything": {"communication_sample_interval": 1, "gpu_telemetry": True,
                   "torch_profiler": {"enabled": True, "start_step": 3, "num_steps": 2, "ranks": [0]}},
    # the default set with a sampled one-step trace every SAMPLED_EVERY steps: what one window costs (issue 44)
    "sampled": {"trace_sample_interval": 5},
}
SAMPLED_EVERY = 5


def scenario_bench(out: Path, steps: int, rounds: int, pipeline: bool = False) -> dict[str, Any]:
    """Median step time (taken here, outside the collector) of the same job under each configuration: the
    data-parallel MLP, or (``pipeline``) the 1F1B pipeline with its p2p traced on every step for the bubble."""
    from profiling.collector import StepCollector

    world = int(os.environ["WORLD_SIZE"])
    microbatches = 4
    if pipeline:
        pipe = _PipelineJob()
        run_step, pp_rank, dp_rank = (lambda: pipe.step(microbatches)), pipe.stage, 0
        shape = {"pipeline": world, "micro": pipe.micro, "global_batch": pipe.micro * microbatches}
    else:
        job = _DPJob(extra_collectives=False, rows=512)  # ~10-50 ms steps here: small, but not launch-bound
        run_step, pp_rank, dp_rank, shape = job.step, 0, int(os.environ["RANK"]), {}
    times: dict[str, list[float]] = {name: [] for name in BENCH_CONFIGS}
    inside: dict[str, list[float]] = {name: [] for name in BENCH_CONFIGS}  # time in start_step + end_step
    windows: list[float] = []  # start_step + end_step of the sampled configuration's traced steps
    for _ in range(3):  # warm the allocator and gloo
        run_step()
    names = list(BENCH_CONFIGS)
    for rnd in range(rounds):
        for name in names[rnd % 3:] + names[:rnd % 3]:  # rotate the order: no configuration always runs first
            profiling = BENCH_CONFIGS[name]
            ctx = make_ctx(out / f"{name}-{rnd}", world, {**profiling, "summary_interval": 10 ** 6}, **shape)
            collector = StepCollector.for_rank(ctx, pp_rank=pp_rank, dp_rank=dp_rank)
            for step in range(1, steps + 1):
                t0 = time.perf_counter()
                collector.start_step(step)
                t1 = time.perf_counter()
                run_step()
                t2 = time.perf_counter()
                collector.end_step(step, loss=None)
                t3 = time.perf_counter()
                times[name].append(t3 - t0)
                inside[name].append((t1 - t0) + (t3 - t2))
                if name == "sampled" and step % SAMPLED_EVERY == 0 and step > ctx.recipe.profiling.warmup_steps:
                    windows.append(inside[name][-1])
            collector.close()
    if pipeline:
        pipe.close()
    medians = {name: statistics.median(v) for name, v in times.items()}
    # The collector's own host time per step is robust to a noisy machine; the step-time ratio is the end-to-end view.
    return {"median_step_s": medians, "steps_per_config": len(times["off"]),
            "ratio": {name: medians[name] / medians["off"] for name in medians},
            "median_collector_s": {name: statistics.median(v) for name, v in inside.items()},
            "mean_collector_s": {name: statistics.fmean(v) for name, v in inside.items()},
            "sampled_windows_s": windows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_tools.testing.workload", description=__doc__)
    parser.add_argument("scenario", choices=("comm", "pipeline", "bench", "bench_pipeline"))
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--interval", type=int, default=2, help="comm: communication_sample_interval")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 8], help="pipeline: m per configuration")
    parser.add_argument("--rounds", type=int, default=3, help="bench: rounds of (off, default, everything)")
    args = parser.parse_args(argv)
    import logging

    import torch.distributed as dist

    logging.basicConfig(level=logging.INFO, format=f"[rank {os.environ.get('RANK')}] %(message)s")

    from hpc_tools.runtime.distenv import join_world

    join_world("gloo")
    try:
        if args.scenario == "comm":
            result = scenario_comm(args.out, args.steps, args.interval)
        elif args.scenario == "pipeline":
            result = scenario_pipeline(args.out, args.steps, args.microbatches)
        else:
            result = scenario_bench(args.out, args.steps, args.rounds, pipeline=args.scenario == "bench_pipeline")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"result_rank{os.environ['RANK']}.json").write_text(json.dumps(result, indent=2))
    return 0


def launch(scenario: str, out: Path, world: int, *args: str, timeout_s: float = 300) -> list[dict[str, Any]]:
    """Run a scenario on ``world`` local ranks (one process each); returns every rank's result with its ``log``."""
    argv = [sys.executable, "-m", "hpc_tools.testing.workload", scenario, "--out", str(out), *args]
    ranks = spawn_ranks(argv, world, timeout_s=timeout_s, check=True)
    return [json.loads((out / f"result_rank{r.rank}.json").read_text()) | {"log": r.log} for r in ranks]


if __name__ == "__main__":
    raise SystemExit(main())
