"""``data.source: indexed``: a recipe's blend of prepared Megatron datasets -> train / valid / test ``Samples``.

Built with megatron.core's ``BlendedMegatronDatasetBuilder`` and ``GPTDataset`` (the same document / sample / shuffle
indices Megatron-LM would build for this blend, split and seed). What this module adds:

* checks first, one line each, naming the blend entry: a missing ``.bin``/``.idx``, a pair whose sizes disagree, a
  tokenizer (from the ``.meta.json`` sidecar of ``data prepare``) larger than ``model.vocab_size``, a split too small
  to hold one sample;
* sizes that depend only on the data, never on ``training.train_iters``: each split asks for one pass over the
  blend's tokens (the sum of every dataset's split samples), so a longer run or a resume with another train_iters
  sees the same samples at the same steps (the step wraps around with a fresh order past the end);
* the index caches: built once and memory-mapped by every rank. With a process group, megatron's builder builds on
  global rank 0 while the others wait at a barrier, then they load; rank 0 also holds a file lock while it builds,
  so two jobs sharing a cache never write the same file at once. Without a process group every process takes the
  file lock in turn (the first builds, the others load). The cache folder is keyed by the datasets' sizes and
  modification times, so a re-prepared dataset never meets a stale index;
* ``Samples`` over the result: a row is ``GPTDataset``'s token window (seq_length + 1 tokens), read from the
  memory-mapped ``.bin``; start-up and memory per rank do not grow with the corpus (only megatron's per-document
  split arange, 4 bytes per document).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import struct
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import numpy as np

from hpc_tools.data.prepare import bin_path, idx_path
from hpc_tools.errors import UserError

if TYPE_CHECKING:
    from hpc_tools.data.samples import Samples
    from hpc_tools.recipe.schema import Recipe

INDEX_HEADER = b"MMIDIDX\x00\x00"
"""The first bytes of a Megatron ``.idx`` file (megatron/core/datasets/indexed_dataset.py ``_INDEX_HEADER``)."""
DTYPE_SIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 8, 8: 2}
"""Item size per dtype code of the ``.idx`` header (megatron's ``DType``: uint8, int8, int16, int32, int64, float64,
float32, uint16)."""
SPLIT_NAMES = ("train", "valid", "test")


def idx_summary(prefix: str, where: str) -> dict:
    """Header facts of ``PREFIX.idx`` (sequences, documents, item size, the token count its pointers imply) after
    checking that ``PREFIX.bin`` holds exactly those bytes. O(1): two small reads."""
    idx, binary = idx_path(prefix), bin_path(prefix)
    for path in (binary, idx):
        if not path.is_file():
            raise UserError(f"{where}={prefix}: {path} does not exist (give the prefix of a prepared dataset: "
                            "python -m hpc_tools data prepare INPUT --out DIR writes DIR/<stem>.bin and .idx)")
    with idx.open("rb") as f:
        head = f.read(34)
        if len(head) < 34 or head[:9] != INDEX_HEADER:
            raise UserError(f"{where}={prefix}: {idx} is not a Megatron index file (prepare the dataset again)")
        code = head[17]
        sequences, documents = struct.unpack("<QQ", head[18:34])
        size = DTYPE_SIZES.get(code)
        if size is None:
            raise UserError(f"{where}={prefix}: {idx} names the unknown token dtype code {code} "
                            "(prepare the dataset again)")
        expected_idx = 34 + sequences * 4 + sequences * 8 + documents * 8
        if idx.stat().st_size < expected_idx:
            raise UserError(f"{where}={prefix}: {idx} is truncated ({idx.stat().st_size} bytes, its header needs "
                            f"{expected_idx}) (prepare the dataset again)")
        last_len, last_ptr = 0, 0
        if sequences:
            f.seek(34 + (sequences - 1) * 4)
            last_len = struct.unpack("<i", f.read(4))[0]
            f.seek(34 + sequences * 4 + (sequences - 1) * 8)
            last_ptr = struct.unpack("<q", f.read(8))[0]
    want = last_ptr + last_len * size
    have = binary.stat().st_size
    if have != want:
        raise UserError(f"{where}={prefix}: {binary} holds {have} bytes but {idx} describes {want} (the .bin and .idx "
                        "come from different runs of data prepare; prepare the dataset again)")
    return {"sequences": sequences, "documents": documents, "itemsize": size, "tokens": want // size}


def check_blend(recipe: "Recipe") -> list[dict]:
    """Every blend entry's summary, after the checks of the module docstring (UserError naming the entry)."""
    from hpc_tools.data.prepare import read_meta

    data, vocab = recipe.data, recipe.model.vocab_size
    if not data.blend:
        raise UserError("data.blend is empty but data.source=indexed (list prepared datasets as "
                        "{path: PREFIX, weight: W})")
    summaries = []
    for i, entry in enumerate(data.blend):
        where = f"data.blend[{i}].path"
        summary = idx_summary(entry.path, where)
        meta = read_meta(entry.path) or {}
        if meta.get("vocab_size") and int(meta["vocab_size"]) > vocab:
            raise UserError(f"model.vocab_size={vocab} is smaller than the {meta['vocab_size']} tokens of the "
                            f"tokenizer that prepared {where}={entry.path} ({meta.get('tokenizer')}) (set "
                            f"model.vocab_size >= {meta['vocab_size']})")
        summary["eos_id"] = meta.get("eos_id")
        summaries.append(summary)
    return summaries


def split_sample_counts(prefix: str, summary: dict, shares: list[float], seq_length: int) -> list[int]:
    """Samples of one pass over each split of one dataset, as GPTDataset counts them (documents split by
    megatron's rounding, tokens from the ``.idx`` pointers: O(1))."""
    from megatron.core.datasets.blended_megatron_dataset_config import convert_split_vector_to_split_matrix

    n = summary["sequences"]
    if n == 0:
        return [0, 0, 0]
    lengths = np.memmap(idx_path(prefix), dtype=np.int32, mode="r", offset=34, shape=(n,))
    pointers = np.memmap(idx_path(prefix), dtype=np.int64, mode="r", offset=34 + 4 * n, shape=(n,))
    matrix = convert_split_vector_to_split_matrix(shares)  # megatron's own book-ends and rounding
    counts = []
    for k in range(3):
        if matrix[k] is None:
            counts.append(0)
            continue
        beg, end = int(round(matrix[k][0] * float(n))), int(round(matrix[k][1] * float(n)))
        if end <= beg:
            counts.append(0)
            continue
        tokens = (int(pointers[end - 1]) - int(pointers[beg])) // summary["itemsize"] + int(lengths[end - 1])
        counts.append(max(0, (tokens - 1) // seq_length))
    return counts


def cache_folder(recipe: "Recipe") -> Path:
    """``data.cache_dir`` (default: ``cache`` next to the first prefix) / a key of the datasets' identities."""
    data = recipe.data
    base = Path(data.cache_dir).expanduser() if data.cache_dir else Path(data.blend[0].path).parent / "cache"
    ident = hashlib.sha256()
    for entry in data.blend:
        for path in (bin_path(entry.path), idx_path(entry.path)):
            st = path.stat()
            ident.update(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns};".encode())
    return base / ident.hexdigest()[:16]


class _DatasetTokenizer:
    """What GPTDataset reads of a tokenizer when it only indexes prepared tokens: the EOS id (no vocab_size: the
    token dtype comes from the .idx header; no pad: megatron picks an id outside the data)."""

    vocab_size = None

    def __init__(self, eos_id: int):
        self.eod = self.eos = eos_id
        self.unique_identifiers = {"class": "prepared-tokens", "eos": eos_id}  # part of megatron's cache key


_BUILT: dict[str, tuple] = {}


def indexed_splits(recipe: "Recipe") -> tuple["Samples", "Samples | None", "Samples | None"]:
    """(train, valid, test) Samples of the recipe's blend; built once per process and recipe (collective when a
    process group exists: every rank calls it, in the same order)."""
    key = recipe.data.model_dump_json() + f"|{recipe.model.seq_length}|{recipe.training.seed}"
    if key not in _BUILT:
        _BUILT.clear()  # one blend per process at a time: the previous one's memory maps go
        with _quiet():
            _BUILT[key] = _build(recipe)
    return _BUILT[key]


def _build(recipe: "Recipe") -> tuple:
    data, seq = recipe.data, recipe.model.seq_length
    summaries = check_blend(recipe)
    from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split

    shares = parse_and_normalize_split(data.split)
    per_dataset = [split_sample_counts(e.path, s, shares, seq) for e, s in zip(data.blend, summaries)]
    for i, counts in enumerate(per_dataset):
        for k in range(3):
            if shares[k] > 0 and counts[k] < 1:
                raise UserError(f"data.split={data.split} leaves the {SPLIT_NAMES[k]} split of data.blend[{i}].path="
                                f"{data.blend[i].path} less than one sample of model.seq_length+1={seq + 1} tokens "
                                "(give that split a larger share, use more data or lower model.seq_length)")
    sizes = [sum(c[k] for c in per_dataset) if shares[k] > 0 else None for k in range(3)]
    cache = cache_folder(recipe)
    eos = next((s["eos_id"] for s in summaries if s.get("eos_id") is not None), -1)
    with _one_builder_at_a_time(cache):
        datasets = _megatron_build(recipe, sizes, str(cache), eos)
    return tuple(_samples(ds, seq, recipe.training.seed + k, f"indexed {SPLIT_NAMES[k]} x{len(data.blend)}")
                 if ds is not None and len(ds) > 0 else None for k, ds in enumerate(datasets))


def _megatron_build(recipe: "Recipe", sizes: list, cache: str, eos: int) -> list:
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    data = recipe.data
    prefixes = [e.path for e in data.blend]
    weights = [float(e.weight) for e in data.blend] if len(prefixes) > 1 else None
    config = GPTDatasetConfig(random_seed=recipe.training.seed, sequence_length=recipe.model.seq_length,
                              blend=(prefixes, weights), split=data.split, path_to_cache=cache,
                              tokenizer=_DatasetTokenizer(eos), reset_position_ids=False, reset_attention_mask=False,
                              eod_mask_loss=False, create_attention_mask=False)
    # A split with no share has no size: megatron skips it (its split matrix entry is None).
    sizes = [s if s is not None else 0 for s in sizes]
    return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()


def _samples(dataset, seq_length: int, seed: int, source: str) -> "Samples":
    """Samples over a megatron BlendedDataset or GPTDataset: rows are token windows from the memory-mapped .bin."""
    from megatron.core.datasets.blended_dataset import BlendedDataset

    from hpc_tools.data.samples import Samples

    if isinstance(dataset, BlendedDataset):
        parts, which, within = dataset.datasets, dataset.dataset_index, dataset.dataset_sample_index

        def get(index: int) -> np.ndarray:
            return parts[int(which[index])]._query_document_sample_shuffle_indices(int(within[index]))[0]
    else:
        def get(index: int) -> np.ndarray:
            return dataset._query_document_sample_shuffle_indices(index)[0]

    def get_rows(indices: np.ndarray) -> np.ndarray:
        out = np.empty((len(indices), seq_length + 1), dtype=np.int64)
        for row, index in enumerate(indices.tolist()):
            out[row] = get(index)
        return out

    return Samples(length=len(dataset), seq_length=seq_length, seed=seed, get=get, get_rows=get_rows, source=source,
                   shuffle=False)


@contextlib.contextmanager
def _one_builder_at_a_time(cache: Path) -> Iterator[None]:
    """Rank 0 (or, without a process group, every process in turn) holds ``cache/.lock`` while it builds or loads."""
    import torch.distributed as dist

    grouped = dist.is_available() and dist.is_initialized()
    if grouped and dist.get_rank() != 0:
        yield  # megatron's builder keeps this rank at a barrier until rank 0 has written the caches
        return
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if grouped:
                yield
            else:
                with _rank_zero_without_group():
                    yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextlib.contextmanager
def _rank_zero_without_group() -> Iterator[None]:
    """megatron's BlendedDataset asks ``torch.distributed.get_rank()`` on a cache miss, which raises without a process
    group; a lone process holding the lock is rank 0 of its own world for that one question."""
    import torch.distributed as dist

    original = dist.get_rank
    dist.get_rank = lambda *args, **kwargs: 0
    try:
        yield
    finally:
        dist.get_rank = original


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """megatron logs every index it builds or loads at INFO and warns about pad tokens; rank logs stay readable."""
    logger = logging.getLogger("megatron.core.datasets")
    level = logger.level
    logger.setLevel(logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            logger.setLevel(level)
