"""``data prepare``: local corpora -> one Megatron indexed dataset per input (``PREFIX.bin`` + ``PREFIX.idx``).

The main process reads each input in chunks of documents (jsonl: raw lines, parsed by the workers) and hands them to
``workers`` forked processes, which tokenize a whole chunk per call (the byte tokenizer, or a local Hugging Face fast
tokenizer in Rust) and append EOS to every document; the main process writes the results, in input order, with
megatron.core's ``IndexedDatasetBuilder`` (so Megatron-LM's own tools read the files). Atomic: everything is written
under hidden temporary names in the output folder and renamed at the end (``.bin`` then ``.idx``, then the
``.meta.json`` sidecar); an interrupted or failed run deletes its temporaries and leaves nothing under a final name.
Every input is checked (exists, format, text field, names free) before anything is written.

The sidecar ``PREFIX.meta.json`` records the tokenizer, its vocabulary size and EOS id and the counts; training uses
it to refuse a ``model.vocab_size`` smaller than the tokenizer's (datasets made by other tools have none and are
taken as they are).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from hpc_tools.data.inputs import Input, JsonLines, open_input
from hpc_tools.data.pool import OrderedPool
from hpc_tools.errors import UserError

BATCH_DOCS = 512
"""Documents per tokenizer call (and per message to a worker): large enough to amortise the round trip."""
META_SUFFIX = ".meta.json"
PROGRESS_EVERY_S = 10.0

_TOKENIZER = None  # set in the parent before the workers fork: they inherit it instead of loading it again


@dataclass
class Prepared:
    """What one input became."""

    input: str
    prefix: str
    documents: int
    tokens: int
    seconds: float

    def as_dict(self) -> dict:
        return {"input": self.input, "prefix": self.prefix, "documents": self.documents, "tokens": self.tokens,
                "seconds": round(self.seconds, 3),
                "tokens_per_s": round(self.tokens / self.seconds, 1) if self.seconds > 0 else None}


def token_dtype(vocab_size: int):
    """The smallest dtype Megatron reads for this vocabulary (uint16 below 65500 tokens, else int32)."""
    from megatron.core.datasets.indexed_dataset import DType

    return DType.optimal_dtype(vocab_size)


def encode_batch(chunk: "Sequence[str] | JsonLines") -> tuple[np.ndarray, np.ndarray]:
    """(tokens of all documents, each followed by EOS, concatenated; per-document lengths incl. EOS) with the
    process's tokenizer. Vectorised: one join of the token lists, EOS placed by index arithmetic."""
    tok = _TOKENIZER
    texts = chunk.documents() if isinstance(chunk, JsonLines) else [t for t in chunk if t]
    ids = tok.encode_batch(texts)
    sizes = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    lengths = sizes + 1
    total = int(lengths.sum())
    flat = np.empty(total, dtype=np.int32)
    ends = np.cumsum(lengths) - 1
    body = np.ones(total, dtype=bool)
    body[ends] = False
    if ids and isinstance(ids[0], (bytes, bytearray)):
        flat[body] = np.frombuffer(b"".join(ids), dtype=np.uint8)
    else:
        flat[body] = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(sizes.sum()))
    flat[ends] = tok.eos_id
    return flat, lengths


def plan_outputs(raw_inputs: Sequence[str], out: str, text_field: str, overwrite: bool) -> list[tuple[Input, Path]]:
    """Every input checked and given its output prefix; refused before anything is written (names taken, clashes)."""
    if not raw_inputs:
        raise UserError("data prepare needs at least one INPUT (local jsonl, parquet or text files)")
    out_dir = Path(out).expanduser()
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out={out} is a file, not a folder (give a folder for the .bin/.idx files)")
    planned: list[tuple[Input, Path]] = []
    seen: dict[str, str] = {}
    for raw in raw_inputs:
        item = open_input(raw, text_field)
        if item.stem in seen:
            raise UserError(f"inputs {seen[item.stem]} and {raw} would both be written as {out_dir / item.stem} "
                            "(rename one, or prepare them into different --out folders)")
        seen[item.stem] = raw
        prefix = out_dir / item.stem
        taken = [p for p in (bin_path(prefix), idx_path(prefix)) if p.exists()]
        if taken and not overwrite:
            raise UserError(f"{taken[0]} already exists (pass --overwrite to replace it, or choose another --out)")
        planned.append((item, prefix))
    return planned


def prepare(raw_inputs: Sequence[str], out: str, *, tokenizer: str = "byte", text_field: str = "text",
            workers: int = 1, overwrite: bool = False, max_vocab: int | None = None,
            batch_docs: int = BATCH_DOCS, log: Callable[[str], None] | None = None) -> list[Prepared]:
    """Tokenize every input into ``OUT/<stem>.bin/.idx`` (see the module docstring); returns one entry per input.

    ``max_vocab``: refuse a tokenizer with more tokens (a recipe's ``model.vocab_size``)."""
    global _TOKENIZER
    from hpc_tools.data.tokenizer import load_tokenizer

    if workers < 1:
        raise UserError(f"--workers={workers} must be at least 1")
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    planned = plan_outputs(raw_inputs, out, text_field, overwrite)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: forked workers and a fair per-worker rate
    tok = load_tokenizer(tokenizer)
    if max_vocab is not None and tok.vocab_size > max_vocab:
        raise UserError(f"model.vocab_size={max_vocab} is smaller than the tokenizer's {tok.vocab_size} tokens "
                        f"(--tokenizer={tokenizer}) (set model.vocab_size >= {tok.vocab_size} or use another "
                        "tokenizer)")
    _TOKENIZER = tok
    pool = OrderedPool(encode_batch, workers) if workers > 1 else None
    out_dir = Path(out).expanduser()
    created = not out_dir.exists()
    temporaries: list[Path] = []
    done: list[Prepared] = []
    try:
        # the pool ends before the clean-up below: closed when every input is written, killed on any error (a
        # worker's input error, Ctrl-C, a dead worker), which ends the other workers at once
        with pool if pool is not None else contextlib.nullcontext():
            out_dir.mkdir(parents=True, exist_ok=True)
            dtype = token_dtype(tok.vocab_size)
            for item, prefix in planned:
                tmp = out_dir / f".{prefix.name}.partial-{os.getpid()}"
                temporaries += [bin_path(tmp), idx_path(tmp), _meta(tmp)]
                done.append(_write_one(item, prefix, tmp, dtype, tok, tokenizer, pool, batch_docs, log))
    except BaseException:
        for path in temporaries:
            path.unlink(missing_ok=True)
        if created and out_dir.is_dir() and not any(out_dir.iterdir()):
            out_dir.rmdir()
        raise
    finally:
        _TOKENIZER = None
    return done


def _write_one(item: Input, prefix: Path, tmp: Path, dtype, tok, spec: str, pool: OrderedPool | None,
               batch_docs: int, log: Callable[[str], None]) -> Prepared:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    t0 = last = time.perf_counter()
    documents = tokens = 0
    builder = IndexedDatasetBuilder(str(bin_path(tmp)), dtype=dtype)
    batches = item.chunks(batch_docs)
    results = pool.imap(batches) if pool is not None else map(encode_batch, batches)
    for flat, lengths in results:
        start = 0
        for length in lengths.tolist():
            builder.add_document(flat[start:start + length], [length])
            start += length
        documents += len(lengths)  # a chunk of only empty documents adds none
        tokens += int(flat.size)
        if time.perf_counter() - last > PROGRESS_EVERY_S:
            last = time.perf_counter()
            log(f"  {item.stem}: {documents:,} documents, {tokens:,} tokens, {tokens / (last - t0):,.0f} tokens/s")
    if documents == 0:
        raise UserError(f"input {item.path} holds no non-empty documents (field {item.text_field}) "
                        "(check the file and --text-field)")
    builder.finalize(str(idx_path(tmp)))
    meta = {"format": "megatron-indexed", "input": str(item.path), "tokenizer": spec, "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id, "dtype": np.dtype(dtype).name, "documents": documents, "tokens": tokens}
    _meta(tmp).write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(bin_path(tmp), bin_path(prefix))  # .bin first: a reader needs the .idx, which comes last
    os.replace(idx_path(tmp), idx_path(prefix))
    os.replace(_meta(tmp), _meta(prefix))
    return Prepared(str(item.path), str(prefix), documents, tokens, time.perf_counter() - t0)


def read_meta(prefix: str | Path) -> dict | None:
    """The sidecar written by ``prepare`` (None for datasets made by other tools, or an unreadable one)."""
    try:
        return json.loads(_meta(Path(prefix)).read_text())
    except (OSError, ValueError):
        return None


def bin_path(prefix: str | Path) -> Path:
    """``PREFIX.bin``, a prepared dataset's tokens (this module names a dataset's files; the readers ask it)."""
    prefix = Path(prefix)
    return prefix.with_name(prefix.name + ".bin")


def idx_path(prefix: str | Path) -> Path:
    """``PREFIX.idx``, a prepared dataset's index."""
    prefix = Path(prefix)
    return prefix.with_name(prefix.name + ".idx")


def _meta(prefix: Path) -> Path:
    return prefix.with_name(prefix.name + META_SUFFIX)
