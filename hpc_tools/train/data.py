"""The data pipeline shared by the Megatron and DeepSpeed trainers.

``build_samples(recipe)`` gives a fixed, indexable set of training windows of ``model.seq_length + 1`` tokens
(inputs plus the shifted labels). ``microbatches_for_step(samples, step, dp_rank, layout)`` gives one data-parallel
rank's microbatches of one optimizer step. The batch of a step is a pure function of (recipe seed, step), so the only
data position a checkpoint needs is the step number, and any layout sees the same global batch.

Order: global sample slot ``g = (step-1) * B + j`` (``j`` < B) falls in epoch ``g // N`` at position ``g % N``; each
epoch is its own seeded permutation of the N samples. Data-parallel rank ``r`` takes slots ``[r B/d, (r+1) B/d)`` of
the step, split into ``num_microbatches`` microbatches of ``micro_batch_size``.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from hpc_tools.errors import UserError
from hpc_tools.train.tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from hpc_tools.layout import ParallelLayout
    from hpc_tools.recipe.schema import Recipe

SYNTHETIC_NUM_SAMPLES = 1 << 16
"""Fixed, so that changing train_iters never changes which tokens a step sees."""
SYNTHETIC_VOCAB = 256
"""Synthetic tokens stay below this (and below model.vocab_size): a small alphabet a tiny model learns quickly."""
SYNTHETIC_BRANCHES = 4
"""Each token is followed by one of this many successors: the entropy floor is ln(4) ~ 1.39 nats plus noise."""
SYNTHETIC_NOISE = 0.05
"""Fraction of tokens replaced by uniform noise."""
EXTENSIONS = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "jsonl", ".json": "jsonl",
              ".parquet": "parquet"}
_BUILDERS = {"text": "text", "jsonl": "json", "parquet": "parquet"}


class Samples:
    """Training windows of ``seq_length + 1`` int64 tokens; ``samples[i]`` is a fresh numpy array."""

    def __init__(self, *, length: int, seq_length: int, seed: int, get: Callable[[int], np.ndarray], source: str):
        self._length = length
        self.seq_length = seq_length
        self.seed = seed
        self._get = get
        self.source = source

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < self._length:
            raise IndexError(f"sample {index} out of range 0..{self._length - 1}")
        return self._get(int(index))

    def __repr__(self) -> str:
        return f"Samples({self.source}, {self._length} x {self.seq_length + 1} tokens, seed {self.seed})"

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The seeded permutation of sample indices for one epoch."""
        return _permutation(self.seed, epoch, self._length)


@lru_cache(maxsize=4)
def _permutation(seed: int, epoch: int, length: int) -> np.ndarray:
    return np.random.default_rng([seed, 0x5EED, epoch]).permutation(length)


# --- building -----------------------------------------------------------------------------------------------------

def build_samples(recipe: "Recipe") -> Samples:
    """The training samples of a recipe: synthetic (seeded) or tokenized local files. Deterministic per seed."""
    if recipe.data.source == "synthetic":
        return synthetic_samples(recipe.model.seq_length, recipe.model.vocab_size, recipe.training.seed)
    tokenizer = load_tokenizer(recipe.data.tokenizer)
    if tokenizer.vocab_size > recipe.model.vocab_size:
        raise UserError(f"model.vocab_size={recipe.model.vocab_size} is smaller than the tokenizer's "
                        f"{tokenizer.vocab_size} tokens (data.tokenizer={recipe.data.tokenizer}) "
                        f"(set vocab_size >= {tokenizer.vocab_size})")
    tokens = tokenize_files(recipe.data.paths, recipe.data.format, recipe.data.text_field, tokenizer)
    return windows(tokens, recipe.model.seq_length, recipe.training.seed, f"files x{len(recipe.data.paths)}")


def synthetic_samples(seq_length: int, vocab_size: int, seed: int, num_samples: int = SYNTHETIC_NUM_SAMPLES) -> Samples:
    """Seeded Markov-chain tokens: learnable (a fixed successor table), so the loss visibly falls in a few steps."""
    vocab = min(vocab_size, SYNTHETIC_VOCAB)
    successors = np.random.default_rng([seed, 0x7AB1E]).integers(vocab, size=(vocab, SYNTHETIC_BRANCHES)).tolist()

    def get(index: int) -> np.ndarray:
        rng = np.random.default_rng([seed, 0xDA7A, index])  # per-sample stream: any index, any order, same tokens
        picks = rng.integers(SYNTHETIC_BRANCHES, size=seq_length).tolist()
        noisy = (rng.random(seq_length) < SYNTHETIC_NOISE).tolist()
        noise = rng.integers(vocab, size=seq_length).tolist()
        out = [int(rng.integers(vocab))]
        for t in range(seq_length):
            out.append(noise[t] if noisy[t] else successors[out[-1]][picks[t]])
        return np.asarray(out, dtype=np.int64)

    return Samples(length=num_samples, seq_length=seq_length, seed=seed, get=get, source="synthetic")


def windows(tokens: np.ndarray, seq_length: int, seed: int, source: str = "tokens") -> Samples:
    """Chunk one token stream into windows of seq_length + 1 (consecutive windows share one boundary token)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    count = (len(tokens) - 1) // seq_length
    if count < 1:
        raise UserError(f"data.paths hold {len(tokens)} tokens, fewer than one sample of model.seq_length+1="
                        f"{seq_length + 1} (add text or lower model.seq_length)")

    def get(index: int) -> np.ndarray:
        return tokens[index * seq_length: index * seq_length + seq_length + 1].copy()

    return Samples(length=count, seq_length=seq_length, seed=seed, get=get, source=source)


# --- files --------------------------------------------------------------------------------------------------------

def resolve_files(paths: list[str], fmt: str) -> list[tuple[Path, str]]:
    """(file, format) for every listed file and every known-format file under listed folders, in a stable order."""
    found: list[tuple[Path, str]] = []
    for i, raw in enumerate(paths):
        path = Path(raw).expanduser()
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and (fmt != "auto" or p.suffix in EXTENSIONS))
            if not files:
                raise UserError(f"data.paths[{i}]={raw} is a folder without data files "
                                f"(put {', '.join(sorted(EXTENSIONS))} files in it)")
        elif path.is_file():
            files = [path]
        else:
            raise UserError(f"data.paths[{i}]={raw} does not exist "
                            "(give local files or folders; nothing is downloaded)")
        for f in files:
            kind = fmt if fmt != "auto" else EXTENSIONS.get(f.suffix.lower())
            if kind is None:
                raise UserError(f"data.paths[{i}]={raw}: cannot tell the format of {f.name} from its extension "
                                f"(set data.format to text, jsonl or parquet)")
            found.append((f, kind))
    return found


def read_documents(file: Path, fmt: str, text_field: str) -> list[str]:
    """The documents of one local file through the `datasets` library (a text file is one document)."""
    datasets = _offline_datasets()
    import tempfile

    # A private cache per call: ranks never race on a shared cache and nothing stale is reused.
    with tempfile.TemporaryDirectory(prefix="hpc_tools_ds_") as cache:
        extra: dict[str, Any] = {"sample_by": "document"} if fmt == "text" else {}
        ds = datasets.load_dataset(_BUILDERS[fmt], data_files=[str(file)], split="train", cache_dir=cache,
                                   keep_in_memory=True, **extra)
        column = "text" if fmt == "text" else text_field
        if column not in ds.column_names:
            raise UserError(f"data.text_field={text_field} is not a column of {file} "
                            f"(its columns: {', '.join(ds.column_names)})")
        return [str(t) for t in ds[column] if t]


def tokenize_files(paths: list[str], fmt: str, text_field: str, tokenizer: Tokenizer) -> np.ndarray:
    """All documents of all files, tokenized and concatenated, each followed by EOS."""
    pieces: list[np.ndarray] = []
    for file, kind in resolve_files(paths, fmt):
        for doc in read_documents(file, kind, text_field):
            pieces.append(np.asarray(tokenizer.encode(doc) + [tokenizer.eos_id], dtype=np.int64))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)


def _offline_datasets():
    """Import `datasets` with the hub switched off: local files only, never a network request."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    import datasets

    # The environment is read at import time; an earlier import (e.g. by transformers) would have missed it.
    datasets.config.HF_DATASETS_OFFLINE = True
    datasets.config.HF_HUB_OFFLINE = True
    return datasets


# --- batches ------------------------------------------------------------------------------------------------------

def global_batch_indices(samples: Samples, step: int, global_batch_size: int) -> np.ndarray:
    """Sample indices of the whole global batch of a (1-based) step, wrapping around epochs."""
    if step < 1:
        raise ValueError(f"steps are 1-based, got step={step}")
    n = len(samples)
    slots = np.arange((step - 1) * global_batch_size, step * global_batch_size, dtype=np.int64)
    out = np.empty(global_batch_size, dtype=np.int64)
    for epoch in np.unique(slots // n):
        mask = slots // n == epoch
        out[mask] = samples.epoch_order(int(epoch))[slots[mask] % n]
    return out


def rank_batch_indices(samples: Samples, step: int, dp_rank: int, layout: "ParallelLayout") -> np.ndarray:
    """This data-parallel rank's contiguous share of the step's global batch."""
    d = layout.data_size
    if not 0 <= dp_rank < d:
        raise ValueError(f"dp_rank={dp_rank} outside 0..{d - 1}")
    share = layout.global_batch_size // d
    return global_batch_indices(samples, step, layout.global_batch_size)[dp_rank * share:(dp_rank + 1) * share]


def microbatches_for_step(samples: Samples, step: int, dp_rank: int, layout: "ParallelLayout") -> list[dict[str, Any]]:
    """One rank's microbatches of a step: ``num_microbatches`` dicts of ``tokens`` and ``labels`` LongTensor[b, s]."""
    import torch

    b = layout.micro_batch_size
    rows = np.stack([samples[int(i)] for i in rank_batch_indices(samples, step, dp_rank, layout)])
    batches = []
    for k in range(layout.num_microbatches):
        chunk = torch.from_numpy(rows[k * b:(k + 1) * b])
        batches.append({"tokens": chunk[:, :-1].contiguous(), "labels": chunk[:, 1:].contiguous()})
    return batches
