"""What quantization costs and saves for one model: for each scheme, the bytes of the linear weights (quantized vs the
same weights as bf16), the folder's size on disk, and the eval score before and after, on the same task and examples.

Each step runs the commands as a user does (``quantize``, ``eval``, in fresh processes) on a run or a Hugging Face
folder (a llama-family model: GPT-2's Conv1D layers are not quantized). Without ``--tasks``, a local multiple-choice
task of ``--examples`` rows ("The WORD is" -> " WORD" or " the", the answer alternating) is written to a temporary
folder and used offline. Results are printed as a table (and written as JSON with ``--json``); the run's eval/
folder keeps the scores (status and the report show them).

    PYTHONPATH=. python benchmarks/bench_quantize.py RUN_OR_HF_DIR [--schemes int8,fp8] [--examples 64]
        [--tasks T --include-path DIR] [--limit N] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TASK = "bench_quantize_choice"
WORDS = ("red", "blue", "green", "cat", "dog", "sun", "moon", "tree", "sea", "bird", "fish", "rain", "snow", "wind",
         "stone", "leaf")


def write_task(folder: Path, examples: int) -> None:
    rows = [{"context": f"The {WORDS[i % len(WORDS)]} is", "choices": [f" {WORDS[i % len(WORDS)]}", " the"],
             "label": i % 2} for i in range(examples)]
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "task.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'rows.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{context}}\"\ndoc_to_target: label\n"
        "doc_to_choice: choices\nmetric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")


def cli(*args: str) -> tuple[dict, float]:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "hpc_tools", *args, "--json"], cwd=REPO, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    if out.returncode != 0:
        sys.exit(f"{' '.join(args[:2])} failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout), time.perf_counter() - t0


def scores(evaluated: dict) -> dict[str, float]:
    (done,) = evaluated["evaluated"]
    return {f"{task} {key.split(',')[0]}": value for task, metrics in done["results"].items()
            for key, value in metrics.items() if "," in key and "_stderr" not in key and isinstance(value, float)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", metavar="RUN_OR_HF_DIR")
    p.add_argument("--schemes", default="int8,fp8")
    p.add_argument("--tasks", default=None)
    p.add_argument("--include-path", default=None)
    p.add_argument("--examples", type=int, default=64, help="rows of the built-in task (without --tasks)")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--json", default=None, help="write the figures to this file")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.tasks is None:
            write_task(tmp, args.examples)
            args.tasks, args.include_path = TASK, str(tmp)
        common = ["--tasks", args.tasks] + (["--include-path", args.include_path] if args.include_path else []) + \
            (["--limit", str(args.limit)] if args.limit else [])
        base, base_s = cli("eval", args.model, *common)
        rows = [{"scheme": "none", "scores": scores(base), "eval_s": base_s}]
        for scheme in args.schemes.split(","):
            q, q_s = cli("quantize", args.model, "--scheme", scheme, "--out", str(tmp / scheme))
            after, after_s = cli("eval", str(tmp / scheme), *common)
            rows.append({"scheme": scheme, "scores": scores(after), "eval_s": after_s, "quantize_s": q_s,
                         **{k: q[k] for k in ("linear_modules", "linear_bytes_bf16", "linear_bytes_after",
                                              "ratio_vs_bf16", "folder_bytes_before", "folder_bytes_after",
                                              "library")}})
    print(f"{'scheme':<7} {'linear B (bf16 -> after)':>26} {'vs bf16':>8} {'folder B (before -> after)':>28} "
          f"{'score (delta)':>30} {'eval s':>7}")
    for r in rows:
        (metric, value), = list(r["scores"].items())[:1]
        delta = value - next(iter(rows[0]["scores"].values()))
        sizes = f"{r['linear_bytes_bf16']:,} -> {r['linear_bytes_after']:,}" if "ratio_vs_bf16" in r else "-"
        ratio = f"{100 * r['ratio_vs_bf16']:.1f} %" if "ratio_vs_bf16" in r else "-"
        folder = f"{r['folder_bytes_before']:,} -> {r['folder_bytes_after']:,}" if "folder_bytes_after" in r else "-"
        print(f"{r['scheme']:<7} {sizes:>26} {ratio:>8} {folder:>28} {f'{metric} {value:.4f} ({delta:+.4f})':>30} "
              f"{r['eval_s']:>7.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
