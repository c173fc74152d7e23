"""The data pipeline shared by the Megatron and DeepSpeed trainers.

``build_samples(recipe)`` gives a fixed, indexable set of training windows of ``model.seq_length + 1`` tokens
(inputs plus the shifted labels). ``microbatches_for_step(samples, step, dp_rank, layout)`` gives one data-parallel
rank's microbatches of one optimizer step. The batch of a step is a pure function of (recipe seed, step), so the only
data position a checkpoint needs is the step number, and any layout sees the same global batch.

Order: global sample slot ``g = (step-1) * B + j`` (``j`` < B) falls in epoch ``g // N`` at position ``g % N``; each
epoch is its own seeded permutation of the N samples. Data-parallel rank ``r`` takes slots ``[r B/d, (r+1) B/d)`` of
the step, split into ``num_microbatches`` microbatches of ``micro_batch_size``. A rank-step's rows are gathered in one
call (``Samples.rows``), vectorised for every source.

Sources: ``synthetic`` (a seeded Markov chain, computed with array ops from a counter-based hash, so any sample is a
pure function of (seed, index)), ``files`` (small local corpora tokenized at start-up) and ``indexed`` (prepared
Megatron datasets, memory-mapped; ``hpc_tools.data.indexed``). ``validation_samples`` gives the held-out samples the
evaluation reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hpc_tools.data.inputs import offline_datasets
from hpc_tools.data.samples import Samples
from hpc_tools.data.tokenizer import Tokenizer, load_tokenizer
from hpc_tools.errors import UserError

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
VALIDATION_SYNTHETIC_SAMPLES = 1 << 12
"""Held-out synthetic samples (chains past the training range)."""
FILES_VALIDATION_FRACTION = 100
"""With evaluation on, the files source holds out its last 1/100 of the windows (at least one)."""
EXTENSIONS = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "jsonl", ".json": "jsonl",
              ".parquet": "parquet"}
_BUILDERS = {"text": "text", "jsonl": "json", "parquet": "parquet"}


# --- building -----------------------------------------------------------------------------------------------------

def build_samples(recipe: "Recipe") -> Samples:
    """The training samples of a recipe: synthetic (seeded), tokenized local files or prepared indexed datasets.
    Deterministic per seed. Collective for source: indexed (every rank calls it; see ``hpc_tools.data.indexed``)."""
    if recipe.data.source == "synthetic":
        return synthetic_samples(recipe.model.seq_length, recipe.model.vocab_size, recipe.training.seed)
    if recipe.data.source == "indexed":
        from hpc_tools.data.indexed import indexed_splits

        return indexed_splits(recipe)[0]
    train, _ = _files_split(recipe)
    return train


def validation_samples(recipe: "Recipe") -> Samples | None:
    """The held-out samples the evaluation reads: synthetic -> windows past the training range (the same chain, never
    trained on); files -> the corpus' last windows (held out of training whenever training.eval_interval is set);
    indexed -> the blend's validation split (None when data.split gives it no share)."""
    if recipe.data.source == "synthetic":
        return synthetic_samples(recipe.model.seq_length, recipe.model.vocab_size, recipe.training.seed,
                                 num_samples=VALIDATION_SYNTHETIC_SAMPLES, first=SYNTHETIC_NUM_SAMPLES)
    if recipe.data.source == "indexed":
        from hpc_tools.data.indexed import indexed_splits

        return indexed_splits(recipe)[1]
    return _files_split(recipe)[1]


def _files_split(recipe: "Recipe") -> tuple[Samples, Samples | None]:
    tokenizer = load_tokenizer(recipe.data.tokenizer)
    if tokenizer.vocab_size > recipe.model.vocab_size:
        raise UserError(f"model.vocab_size={recipe.model.vocab_size} is smaller than the tokenizer's "
                        f"{tokenizer.vocab_size} tokens (data.tokenizer={recipe.data.tokenizer}) "
                        f"(set vocab_size >= {tokenizer.vocab_size})")
    tokens = tokenize_files(recipe.data.paths, recipe.data.format, recipe.data.text_field, tokenizer)
    source = f"files x{len(recipe.data.paths)}"
    seq, seed = recipe.model.seq_length, recipe.training.seed
    if not getattr(recipe.training, "eval_interval", None):
        return windows(tokens, seq, seed, source), None
    count = (len(tokens) - 1) // seq
    held = max(1, count // FILES_VALIDATION_FRACTION)
    if count - held < 1:
        raise UserError(f"data.paths hold {len(tokens)} tokens: too few to hold out validation windows of "
                        f"model.seq_length+1={seq + 1} (add text, lower model.seq_length or unset "
                        "training.eval_interval)")
    cut = (count - held) * seq
    return windows(tokens[:cut + 1], seq, seed, source), windows(tokens[cut:], seq, seed + 1, source + " (valid)")


def synthetic_samples(seq_length: int, vocab_size: int, seed: int, num_samples: int = SYNTHETIC_NUM_SAMPLES,
                      first: int = 0) -> Samples:
    """Seeded Markov-chain tokens: learnable (each token has SYNTHETIC_BRANCHES successors), so the loss visibly falls
    in a few steps. Sample ``i`` is chain ``first + i``: ``first`` picks a disjoint region (held-out validation).

    The chain runs on a hidden state s in 0..vocab-1: s' = s + offsets[pick] (mod vocab), or a uniform noise state
    with probability SYNTHETIC_NOISE; the token is relabel[s] (a seeded permutation), so the successor table looks
    random. Additive steps make the chain a cumulative sum, so whole batches are computed with array ops from a
    counter-based hash of (seed, sample, position): any index, any order, same tokens, no per-token Python."""
    vocab = min(vocab_size, SYNTHETIC_VOCAB)
    table = np.random.default_rng([seed, 0x7AB1E])
    offsets = table.integers(0, vocab, size=SYNTHETIC_BRANCHES).astype(np.int32)
    relabel = table.permutation(vocab).astype(np.int64)
    key = np.uint32(int(table.integers(1 << 32)))
    positions = np.arange(seq_length + 1, dtype=np.uint32) * np.uint32(0x85EBCA77)
    cols = np.arange(seq_length + 1, dtype=np.int32) << 16
    noise_cut = np.uint32(int(SYNTHETIC_NOISE * 65536))
    mod = (lambda x: x & (vocab - 1)) if vocab & (vocab - 1) == 0 else (lambda x: x % vocab)

    def get_rows(indices: np.ndarray) -> np.ndarray:
        chains = (np.asarray(indices, dtype=np.int64) + first).astype(np.uint32) * np.uint32(0x9E3779B1) + key
        h = _mix32(chains[:, None] + positions[None, :])  # 32 hash bits per token: 2 pick, 14 noise state, 16 reset
        reset = (h >> np.uint32(16)) < noise_cut
        reset[:, 0] = True  # every sample starts from a uniform state
        noise = (((h >> np.uint32(2)) & np.uint32(0x3FFF)) * np.uint32(vocab) >> np.uint32(14)).astype(np.int32)
        total = np.cumsum(offsets[(h & np.uint32(SYNTHETIC_BRANCHES - 1)).astype(np.intp)], axis=1, dtype=np.int32)
        # the state after the latest reset r <= t is noise[r] + total[t] - total[r]: carry (noise - total)[r] forward
        # with a running maximum of (position << 16 | value), which only the later reset can exceed
        carried = np.maximum.accumulate(np.where(reset, cols | mod(noise - total), 0), axis=1) & 0xFFFF
        return relabel[mod(carried + total)]

    def get(index: int) -> np.ndarray:
        return get_rows(np.asarray([index]))[0]

    return Samples(length=num_samples, seq_length=seq_length, seed=seed, get=get, get_rows=get_rows,
                   source="synthetic" if not first else f"synthetic from {first}")


def _mix32(x: np.ndarray) -> np.ndarray:
    """MurmurHash3's 32-bit finaliser: a bijective mix whose outputs pass as independent uniform bits."""
    x = (x ^ (x >> np.uint32(16))) * np.uint32(0x85EBCA6B)
    x = (x ^ (x >> np.uint32(13))) * np.uint32(0xC2B2AE35)
    return x ^ (x >> np.uint32(16))


def windows(tokens: np.ndarray, seq_length: int, seed: int, source: str = "tokens") -> Samples:
    """Chunk one token stream into windows of seq_length + 1 (consecutive windows share one boundary token)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    count = (len(tokens) - 1) // seq_length
    if count < 1:
        raise UserError(f"data.paths hold {len(tokens)} tokens, fewer than one sample of model.seq_length+1="
                        f"{seq_length + 1} (add text or lower model.seq_length)")
    span = np.arange(seq_length + 1, dtype=np.int64)

    def get(index: int) -> np.ndarray:
        return tokens[index * seq_length: index * seq_length + seq_length + 1].copy()

    def get_rows(indices: np.ndarray) -> np.ndarray:
        return tokens[indices[:, None] * seq_length + span[None, :]]

    return Samples(length=count, seq_length=seq_length, seed=seed, get=get, get_rows=get_rows, source=source)


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
    datasets = offline_datasets()
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
        out[mask] = samples.order_at(int(epoch), slots[mask] % n)
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
    rows = torch.from_numpy(samples.rows(rank_batch_indices(samples, step, dp_rank, layout)))
    tokens, labels = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()  # two copies for the whole rank-step
    return [{"tokens": tokens[k * b:(k + 1) * b], "labels": labels[k * b:(k + 1) * b]}
            for k in range(layout.num_microbatches)]
