"""``python -m hpc_tools.job.restarts begin|next|watch``: the batch script's calls, the recipe's cluster facts as
options (else read from the run's recipe); whatever fails here, the batch script goes on to its epilogue."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from hpc_tools.job.restarts.decision import begin, next_step
from hpc_tools.job.restarts.facts import Policy
from hpc_tools.job.restarts.stuck import watch


def main(argv: list[str] | None = None) -> int:
    doc = sys.modules["hpc_tools.job.restarts"].__doc__ or ""  # the package's first line
    parser = argparse.ArgumentParser(prog="python -m hpc_tools.job.restarts", description=doc.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    b = sub.add_parser("begin", help="exports of this life's first rank step")
    b.add_argument("--run-dir", required=True, type=Path)
    n = sub.add_parser("next", help="after a failed rank step: exports of a new step (exit 0) or none (exit 1)")
    n.add_argument("--run-dir", required=True, type=Path)
    n.add_argument("--exit-code", required=True, type=int)
    for p in (b, n):  # the recipe's cluster facts, given by the batch script (else read from the run's recipe)
        p.add_argument("--nodes", type=int, default=None, help="cluster.nodes")
        p.add_argument("--budget", type=int, default=None, help="cluster.restarts")
        p.add_argument("--requeue", action=argparse.BooleanOptionalAction, default=None, help="cluster.requeue")
        p.add_argument("--min-nodes", type=int, default=None, help="cluster.min_nodes (elastic)")
        p.add_argument("--ranks-per-node", type=int, default=1, help="cluster.gpus_per_node (elastic)")
    w = sub.add_parser("watch", help="beside a rank step: cancel it when it outlives a failed rank (a lost node)")
    w.add_argument("--run-dir", required=True, type=Path)
    args = parser.parse_args(argv)
    env = dict(os.environ)
    given = [getattr(args, k, None) for k in ("nodes", "budget", "requeue")]
    policy = Policy(*given, min_nodes=getattr(args, "min_nodes", None),
                    ranks_per_node=getattr(args, "ranks_per_node", 1)) if None not in given else None
    try:
        if args.what == "begin":
            print(begin(args.run_dir, env, policy))
            return 0
        if args.what == "watch":
            watch(args.run_dir, env)
            return 0
        line = next_step(args.run_dir, args.exit_code, env, policy=policy)
    except Exception as exc:  # the batch script must reach its epilogue whatever happens here
        print(f"hpc_tools restarts: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if line is None:
        return 1
    print(line)
    return 0
