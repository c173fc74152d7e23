"""Serving figures of ``hpc_tools serve`` (Triton through PyTriton, local executor): time from ``serve`` to ready,
time to first token, and generated tokens/s with 1 and with 8 requests in flight.

    python benchmarks/bench_serve.py [--model HF_DIR] [--tokens 32] [--requests 16] [--repeats 3] [--json]

Without --model it serves a tiny Llama built here (the local profile of recipes/llama_fsdp.yaml: 2 layers, hidden 64,
vocabulary 512, random weights; nothing downloaded). The serving environment must be installed
(``bash environment/install-serve.sh``).

- time to first token: the median latency of a request for one new token (a 16-token prompt); ``generate`` answers
  a request whole (no streaming), so the first token's time is that of a one-token request;
- tokens/s at concurrency C: ``--requests`` requests of ``--tokens`` new tokens each (16-token prompts, all of one
  length so that Triton's dynamic batcher may decode them together), C in flight at a time; generated tokens (an
  early end-of-sequence counts what came) over the wall time of them all; ``--repeats`` measurements per C,
  alternating between C=1 and C=8, the median shown with all of them; the mean batch the server decoded is printed
  beside it (the model's ``batch_size`` output).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
PROMPT_LEN = 16


def cli(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpc_tools", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "HPC_TOOLS_SLURM": "off"})


def tiny_model(folder: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from hpc_tools.hf.config import hf_config
    from hpc_tools.recipe.load import load_recipe

    torch.manual_seed(0)
    recipe = load_recipe(str(REPO / "recipes" / "llama_fsdp.yaml"), profile="local")
    AutoModelForCausalLM.from_config(hf_config(recipe)).save_pretrained(folder)
    return folder


def prompts(n: int, vocab: int) -> list[list[int]]:
    return [[(7 * i + 13 * j + 1) % vocab for j in range(PROMPT_LEN)] for i in range(n)]


def measure(endpoint, bodies: list[dict], concurrency: int) -> dict:
    from hpc_tools.serving.client import infer

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        answers = list(pool.map(lambda b: infer(endpoint, b), bodies))
    wall = time.perf_counter() - t0
    tokens = sum(len(a["ids"]) for a in answers)
    return {"concurrency": concurrency, "requests": len(bodies), "tokens": tokens, "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 1),
            "mean_batch": round(statistics.mean(a["batch_size"] or 1 for a in answers), 2)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="Hugging Face folder to serve (default: a tiny Llama built here)")
    p.add_argument("--tokens", type=int, default=32, help="new tokens per request (default 32)")
    p.add_argument("--requests", type=int, default=16, help="requests per throughput measurement (default 16)")
    p.add_argument("--repeats", type=int, default=3, help="measurements per concurrency; the median is shown")
    p.add_argument("--ttft-requests", type=int, default=20)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    from hpc_tools.serving.client import Endpoint, infer, request_body

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else tiny_model(Path(tmp) / "tiny-llama")
        vocab = json.loads((model / "config.json").read_text()).get("vocab_size", 256)
        t0 = time.perf_counter()
        out = cli("serve", str(model), "--executor", "local", "--http-port", "0", "--grpc-port", "0", "--json",
                  "--runs-dir", str(Path(tmp) / "runs"))
        ready_s = time.perf_counter() - t0
        if out.returncode != 0:
            print(out.stderr.strip().splitlines()[-1], file=sys.stderr)
            return out.returncode
        served = json.loads(out.stdout)
        try:
            endpoint = Endpoint(served["endpoint"]["host"], served["endpoint"]["http_port"])
            infer(endpoint, request_body(None, prompts(1, vocab)[0], 4))  # warm-up
            ttft = []
            for ids in prompts(args.ttft_requests, vocab):
                t = time.perf_counter()
                infer(endpoint, request_body(None, ids, 1))
                ttft.append(time.perf_counter() - t)
            bodies = [request_body(None, ids, args.tokens) for ids in prompts(args.requests, vocab)]
            runs = {1: [], 8: []}
            for _ in range(args.repeats):  # alternating, so that a busy spell of the machine hits both
                for c in runs:
                    runs[c].append(measure(endpoint, bodies, c))
            rows = [{**sorted(found, key=lambda r: r["tokens_per_s"])[len(found) // 2],
                     "tokens_per_s_all": [r["tokens_per_s"] for r in found]} for found in runs.values()]
        finally:
            cli("cancel", served["run_dir"])
    result = {"model": str(args.model or "tiny Llama (llama_fsdp local profile, random weights)"),
              "serve_to_ready_s": round(ready_s, 1), "ttft_ms_median": round(1000 * statistics.median(ttft), 1),
              "new_tokens_per_request": args.tokens, "prompt_tokens": PROMPT_LEN, "throughput": rows,
              "cpus": os.cpu_count()}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"serve -> ready: {result['serve_to_ready_s']} s; time to first token (median of {len(ttft)}): "
          f"{result['ttft_ms_median']} ms; {PROMPT_LEN}-token prompts, {args.tokens} new tokens each, "
          f"{os.cpu_count()} CPUs")
    print(f"{'in flight':>9} {'requests':>8} {'tokens':>7} {'wall s':>7} {'tokens/s':>9} {'mean batch':>10}  "
          "tokens/s of every measurement")
    for r in rows:
        print(f"{r['concurrency']:>9} {r['requests']:>8} {r['tokens']:>7} {r['wall_s']:>7} {r['tokens_per_s']:>9} "
              f"{r['mean_batch']:>10}  {r['tokens_per_s_all']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
