"""Start-up cost of a rank's training library on a CPU-only torch: the import of megatron-core and of DeepSpeed as a
rank made it before and as it makes it now (``hpc_tools.train.megatron.cpu_compat.import_megatron``: no
TorchDynamo/Inductor behind the fusion decorators, no wandb behind the inference context, no tensorboard behind the
timers; ``hpc_tools.train.deepspeed.trainer.import_deepspeed``: no mlflow behind the autotuner), and a rank's first
optimizer step (``--library dynamo``: ``hpc_tools.train.dynamo_lazy``, no TorchDynamo behind torch.optim). Each
figure is a fresh interpreter importing torch first (timed apart) and then the modules a rank imports; the two ways
alternate, so both see the same load.

    PYTHONPATH=. python benchmarks/bench_rank_import.py [--repeats 5] [--library megatron|deepspeed|dynamo|all]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

CHILD = {
    "megatron": r'''
import sys, time
import torch
t = time.perf_counter()
if sys.argv[1] == "now":
    from hpc_tools.train.megatron import cpu_compat
    cpu_compat.import_megatron()
import megatron.core.models.gpt, megatron.core.optimizer, megatron.core.pipeline_parallel, megatron.core.distributed
print(time.perf_counter() - t, *(m in sys.modules for m in ("torch._dynamo", "wandb", "torch.utils.tensorboard")))
''',
    "deepspeed": r'''
import sys, time
import torch
t = time.perf_counter()
if sys.argv[1] == "now":
    from hpc_tools.train.deepspeed.trainer import import_deepspeed
    import_deepspeed()
import deepspeed, deepspeed.ops
print(time.perf_counter() - t, *(m in sys.modules for m in ("mlflow",)))
''',
    "dynamo": r'''
import sys, time
import torch
t = time.perf_counter()
if sys.argv[1] == "now":
    from hpc_tools.train import dynamo_lazy
    dynamo_lazy.install()
p = torch.nn.Parameter(torch.ones(4))
opt = torch.optim.AdamW([p], lr=0.1)
p.grad = torch.ones(4)
opt.step()
opt.zero_grad()
print(time.perf_counter() - t, *(m in sys.modules for m in ("torch._dynamo",)))
'''}
LEFT_OUT = {"megatron": ("TorchDynamo", "wandb", "tensorboard"), "deepspeed": ("mlflow",), "dynamo": ("TorchDynamo",)}


def once(library: str, way: str) -> tuple[float, list[bool]]:
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", CHILD[library], way], capture_output=True, text=True,
                         check=True).stdout.split()
    return float(out[-1 - len(LEFT_OUT[library])]), [x == "True" for x in out[-len(LEFT_OUT[library]):]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--library", choices=[*CHILD, "all"], default="all")
    args = ap.parse_args()
    for library in CHILD if args.library == "all" else [args.library]:
        seen: dict[str, list[tuple[float, list[bool]]]] = {"before": [], "now": []}
        for _ in range(args.repeats):
            for way in seen:
                seen[way].append(once(library, way))
        for way, runs in seen.items():
            secs = [r[0] for r in runs]
            loaded = ", ".join(f"{name} loaded: {flag}" for name, flag in zip(LEFT_OUT[library], runs[0][1]))
            print(f"{library} {way:7s} import after torch: median {statistics.median(secs):.2f} s "
                  f"(min {min(secs):.2f}, max {max(secs):.2f}, {len(secs)} runs); {loaded}")
        before, now = (statistics.median(r[0] for r in seen[w]) for w in ("before", "now"))
        print(f"{library} now / before: {now / before:.2f}")


if __name__ == "__main__":
    main()
