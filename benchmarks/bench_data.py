"""The data path's host costs: prepare throughput, rank start-up on prepared data, and a rank-step's batch build.

1. ``data prepare`` throughput on a generated jsonl corpus (``--mb`` MB) with a BPE tokenizer trained here
   (``tokenizers``; nothing downloaded): tokens/s with 1 and 2 workers and per worker, next to a bare
   ``tokenizers`` ``encode_batch`` of the same texts in the same run (one thread: TOKENIZERS_PARALLELISM=false,
   as in the workers). The prepare figures cover reading, tokenizing, EOS and writing the .bin/.idx.
2. Rank start-up on ``data.source: indexed``: a fresh process builds the train Samples of a 2-dataset blend (index
   caches already built, as every rank but the first finds them) from a corpus and from one 10x larger; time and
   resident memory added by the build (megatron already imported, so the figure is the data's own cost). Both must
   stay flat.
3. gpt_3d's rank-step batch build (recipes/gpt_3d.yaml at DP4: 64 samples x 2049 tokens, 32 microbatches): the
   token-by-token synthetic loop this module used before (reimplemented below as the baseline) vs
   ``microbatches_for_step`` now (goal < 5 ms).

    PYTHONPATH=. python benchmarks/bench_data.py [--mb 8] [--json out.json]
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

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ["TOKENIZERS_PARALLELISM"] = "false"

WORDS = ("the of and to in a is that for it as was with be by on not he this are or his from at which but have an "
         "they you were their one all we can her has there been if more when will would who so no data parallel "
         "tensor pipeline gradient optimizer checkpoint throughput latency scheduler").split()


def write_corpus(path: Path, mb: float, seed: int) -> int:
    """Random-word documents (20-400 words) until the file holds ``mb`` MB; returns the document count."""
    rng = np.random.default_rng(seed)
    target, written, docs = int(mb * 1e6), 0, 0
    with path.open("w") as f:
        while written < target:
            text = " ".join(rng.choice(WORDS, size=int(rng.integers(20, 400))))
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            written += len(line)
            docs += 1
    return docs


def train_tokenizer(corpus: Path, folder: Path) -> None:
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    texts = [json.loads(line)["text"] for _, line in zip(range(2000), corpus.open())]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=8000, special_tokens=["<|endoftext|>"], show_progress=False)
    PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>").save_pretrained(folder)


def bench_prepare(work: Path, mb: float) -> dict:
    from tokenizers import Tokenizer

    from hpc_tools.data.prepare import prepare

    corpus = work / "corpus.jsonl"
    docs = write_corpus(corpus, mb, 0)
    train_tokenizer(corpus, work / "tok")
    texts = [json.loads(line)["text"] for line in corpus.open()]
    bare = Tokenizer.from_file(str(work / "tok" / "tokenizer.json"))
    t0 = time.perf_counter()
    n_bare = sum(len(e.ids) for e in bare.encode_batch(texts, add_special_tokens=False))
    bare_s = time.perf_counter() - t0
    out = {"corpus_mb": mb, "documents": docs, "bare_tokenizers_tokens_per_s": n_bare / bare_s, "prepare": {}}
    prepare([str(corpus)], str(work / "warm"), tokenizer="byte")  # imports megatron once, outside the timings
    for spec in ("bpe", "byte"):
        for workers in (1, 2):
            (done,) = prepare([str(corpus)], str(work / f"{spec}{workers}"),
                              tokenizer=str(work / "tok") if spec == "bpe" else "byte", workers=workers)
            rate = done.tokens / done.seconds
            out["prepare"][f"{spec} x{workers}"] = {"tokens": done.tokens, "seconds": done.seconds,
                                                    "tokens_per_s": rate, "tokens_per_s_per_worker": rate / workers}
    return out


STARTUP = r"""
import json, os, resource, sys, time, warnings
warnings.simplefilter("ignore")
sys.path.insert(0, {repo!r})
import megatron.core.datasets.blended_megatron_dataset_builder  # imported before the clock: not the data's cost
from hpc_tools.recipe.load import resolve
from hpc_tools.train.data import build_samples, microbatches_for_step
from hpc_tools.layout import ParallelLayout

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

recipe = resolve({{"name": "b", "model": {{"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                  "seq_length": 512, "vocab_size": 512}},
                  "training": {{"micro_batch_size": 4, "global_batch_size": 16}},
                  "cluster": {{"gpus_per_node": 1, "gpu_type": "cpu"}},
                  "data": {{"source": "indexed", "blend": {blend!r}, "split": "98,1,1"}}}})
r0, t0 = rss(), time.perf_counter()
samples = build_samples(recipe)
t1 = time.perf_counter()
microbatches_for_step(samples, 1, 0, ParallelLayout.from_recipe(recipe))
print(json.dumps({{"samples": len(samples), "build_s": t1 - t0, "first_step_s": time.perf_counter() - t1,
                  "rss_added_mb": (rss() - r0) / 1e6}}))
"""


def bench_startup(work: Path, mb: float) -> dict:
    from hpc_tools.data.prepare import prepare

    out = {}
    for scale in (1, 10):
        folder = work / f"x{scale}"
        folder.mkdir()
        for name, seed in (("a", 1), ("b", 2)):
            write_corpus(folder / f"{name}.jsonl", mb * scale / 2, seed)
        prepare([str(folder / "a.jsonl"), str(folder / "b.jsonl")], str(folder / "data"), workers=2)
        blend = [{"path": str(folder / "data" / "a"), "weight": 0.5}, {"path": str(folder / "data" / "b"),
                                                                         "weight": 0.5}]
        code = STARTUP.format(repo=str(REPO), blend=blend)
        runs = []
        for _ in range(3):  # the first builds the caches (rank 0); the next ones are what every other rank sees
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
            if proc.returncode != 0:
                raise SystemExit(proc.stderr[-3000:])
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        tokens = sum(json.loads((folder / "data" / f"{n}.meta.json").read_text())["tokens"] for n in "ab")
        out[f"x{scale}"] = {"tokens": tokens, "first_build": runs[0], "cached": min(runs[1:],
                                                                                   key=lambda r: r["build_s"])}
    return out


def old_synthetic_rows(seq_length: int, vocab_size: int, seed: int, indices) -> np.ndarray:
    """The baseline: the per-token Python loop ``synthetic_samples`` ran before (one sample at a time)."""
    vocab = min(vocab_size, 256)
    successors = np.random.default_rng([seed, 0x7AB1E]).integers(vocab, size=(vocab, 4)).tolist()
    rows = []
    for index in indices:
        rng = np.random.default_rng([seed, 0xDA7A, int(index)])
        picks = rng.integers(4, size=seq_length).tolist()
        noisy = (rng.random(seq_length) < 0.05).tolist()
        noise = rng.integers(vocab, size=seq_length).tolist()
        out = [int(rng.integers(vocab))]
        for t in range(seq_length):
            out.append(noise[t] if noisy[t] else successors[out[-1]][picks[t]])
        rows.append(np.asarray(out, dtype=np.int64))
    return np.stack(rows)


def bench_rank_step(repeat: int) -> dict:
    import torch

    from hpc_tools.layout import ParallelLayout
    from hpc_tools.recipe.load import load_recipe
    from hpc_tools.train.data import build_samples, microbatches_for_step, rank_batch_indices

    torch.set_num_threads(1)
    recipe = load_recipe(REPO / "recipes" / "gpt_3d.yaml")
    layout = ParallelLayout.from_recipe(recipe)
    samples = build_samples(recipe)
    seq = recipe.model.seq_length
    rows = len(rank_batch_indices(samples, 1, 0, layout))

    def before(step):
        idx = rank_batch_indices(samples, step, 0, layout)
        chunk = torch.from_numpy(old_synthetic_rows(seq, recipe.model.vocab_size, recipe.training.seed, idx))
        b = layout.micro_batch_size
        return [{"tokens": chunk[k * b:(k + 1) * b, :-1].contiguous(), "labels": chunk[k * b:(k + 1) * b, 1:]
                 .contiguous()} for k in range(layout.num_microbatches)]

    def timed(fn, n):
        best = float("inf")
        for step in range(1, n + 1):
            t0 = time.perf_counter()
            fn(step)
            best = min(best, time.perf_counter() - t0)
        return best

    old_s = timed(before, 2)
    new_s = timed(lambda step: microbatches_for_step(samples, step, 0, layout), repeat)
    return {"rows": rows, "tokens": rows * (seq + 1), "microbatches": layout.num_microbatches,
            "before_ms": old_s * 1e3, "after_ms": new_s * 1e3, "speedup": old_s / new_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=8.0, help="prepare corpus size in MB (start-up: 2 MB and 20 MB)")
    parser.add_argument("--startup-mb", type=float, default=2.0, help="the smaller start-up corpus (MB)")
    parser.add_argument("--repeat", type=int, default=20, help="rank-step builds timed (best of)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
        work = Path(tmp)
        results["rank_step"] = bench_rank_step(args.repeat)
        r = results["rank_step"]
        print(f"gpt_3d rank-step batch ({r['rows']} x {r['tokens'] // r['rows']} tokens, {r['microbatches']} "
              f"microbatches): before {r['before_ms']:.1f} ms, after {r['after_ms']:.2f} ms ({r['speedup']:.0f}x)")
        (work / "p").mkdir()
        results["prepare"] = bench_prepare(work / "p", args.mb)
        p = results["prepare"]
        print(f"prepare {p['corpus_mb']} MB jsonl ({p['documents']:,} documents); bare tokenizers encode_batch "
              f"(1 thread): {p['bare_tokenizers_tokens_per_s']:,.0f} tokens/s")
        for name, f in p["prepare"].items():
            print(f"  {name:8s} {f['tokens_per_s']:>12,.0f} tokens/s  ({f['tokens_per_s_per_worker']:,.0f} per worker)")
        (work / "s").mkdir()
        results["startup"] = bench_startup(work / "s", args.startup_mb)
        for name, f in results["startup"].items():
            c, first = f["cached"], f["first_build"]
            print(f"start-up {name}: {f['tokens']:,} tokens, {c['samples']:,} samples: "
                  f"build {c['build_s'] * 1e3:.0f} ms,"
                  f" +{c['rss_added_mb']:.1f} MB RSS, first step {c['first_step_s'] * 1e3:.1f} ms (cache miss, first "
                  f"rank: {first['build_s'] * 1e3:.0f} ms, +{first['rss_added_mb']:.1f} MB)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
