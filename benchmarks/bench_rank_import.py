"""Start-up cost of a Megatron-core rank on a CPU-only torch: the import of megatron-core as a rank made it before and
as it makes it now (``hpc_tools.train.megatron.cpu_compat.import_megatron``: no TorchDynamo/Inductor behind the
fusion decorators, no wandb behind the inference context). Each figure is a fresh interpreter importing torch first
(timed apart) and then the modules a Megatron rank imports; the two ways alternate, so both see the same load.

    PYTHONPATH=. python benchmarks/bench_rank_import.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

CHILD = r'''
import sys, time
import torch
t = time.perf_counter()
if sys.argv[1] == "now":
    from hpc_tools.train.megatron import cpu_compat
    cpu_compat.import_megatron()
import megatron.core.models.gpt, megatron.core.optimizer, megatron.core.pipeline_parallel, megatron.core.distributed
print(time.perf_counter() - t, "torch._dynamo" in sys.modules, "wandb" in sys.modules)
'''


def once(way: str) -> tuple[float, bool, bool]:
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", CHILD, way], capture_output=True, text=True,
                         check=True).stdout.split()
    return float(out[0]), out[1] == "True", out[2] == "True"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    seen: dict[str, list[tuple[float, bool, bool]]] = {"before": [], "now": []}
    for _ in range(args.repeats):
        for way in seen:
            seen[way].append(once(way))
    for way, runs in seen.items():
        secs = [r[0] for r in runs]
        print(f"{way:7s} megatron-core import after torch: median {statistics.median(secs):.2f} s "
              f"(min {min(secs):.2f}, max {max(secs):.2f}, {len(secs)} runs); TorchDynamo loaded: {runs[0][1]}, "
              f"wandb loaded: {runs[0][2]}")
    before, now = (statistics.median(r[0] for r in seen[w]) for w in ("before", "now"))
    print(f"now / before: {now / before:.2f}")


if __name__ == "__main__":
    main()
