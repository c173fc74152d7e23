"""The inputs of ``data prepare``: local jsonl / parquet / text files or a folder written by ``Dataset.save_to_disk``.

``open_input`` checks an input before anything is written (it exists, its format is known, the text field is there)
and ``Input.chunks`` streams it in pieces of at most ``batch_docs`` documents, so a corpus larger than memory is read
piece by piece: lists of document strings, or, for jsonl, ``JsonLines`` (raw lines that the tokenizer workers parse
themselves, so JSON decoding scales with the workers too). Empty documents are skipped (as the ``files`` source
does). Nothing is downloaded.
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from hpc_tools.errors import UserError

TEXT_SUFFIXES = (".txt", ".text", ".md")
JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
SAVED_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
"""A folder holding one of these was written by ``datasets``' ``save_to_disk``."""


@dataclass(frozen=True)
class Input:
    """One input: its path, its kind (jsonl, parquet, text, saved) and the field holding the text."""

    path: Path
    kind: str
    text_field: str

    @property
    def stem(self) -> str:
        """The output prefix's name: the file name without its suffix (a saved dataset: the folder name)."""
        return self.path.name if self.kind == "saved" else self.path.stem

    def chunks(self, batch_docs: int) -> Iterator["list[str] | JsonLines"]:
        """Pieces of at most ``batch_docs`` documents, in file order (see the module docstring)."""
        if self.kind != "jsonl":
            yield from self.batches(batch_docs)
            return
        with self.path.open(encoding="utf-8") as stream:
            first = 1
            while True:
                lines = list(itertools.islice(stream, batch_docs))
                if not lines:
                    return
                yield JsonLines(self.path, self.text_field, first, lines)
                first += len(lines)

    def batches(self, batch_docs: int) -> Iterator[list[str]]:
        """The non-empty documents, in file order, in lists of at most ``batch_docs``."""
        reader = {"jsonl": self._jsonl, "parquet": self._parquet, "text": self._text, "saved": self._saved}[self.kind]
        batch: list[str] = []
        for doc in reader(batch_docs):
            if doc:
                batch.append(doc)
                if len(batch) >= batch_docs:
                    yield batch
                    batch = []
        if batch:
            yield batch

    def _text(self, _batch_docs: int) -> Iterator[str]:
        yield self.path.read_text(encoding="utf-8", errors="replace")  # one file = one document, as source: files

    def _jsonl(self, batch_docs: int) -> Iterator[str]:
        for chunk in self.chunks(batch_docs):
            yield from chunk.documents()

    def _parquet(self, batch_docs: int) -> Iterator[str]:
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(self.path).iter_batches(batch_size=batch_docs, columns=[self.text_field]):
            for value in batch.column(0).to_pylist():
                yield "" if value is None else str(value)

    def _saved(self, batch_docs: int) -> Iterator[str]:
        ds = _load_saved(self.path)
        for batch in ds.iter(batch_size=batch_docs):
            for value in batch[self.text_field]:
                yield "" if value is None else str(value)


@dataclass(frozen=True)
class JsonLines:
    """Raw lines of a jsonl file, from line ``first`` on: parsed where they are tokenized."""

    path: Path
    text_field: str
    first: int
    lines: list[str]

    def documents(self) -> list[str]:
        """The non-empty texts of these lines (UserError naming the line for a bad one)."""
        out = []
        for number, line in enumerate(self.lines, self.first):
            if not line.strip():
                continue
            record = _json_record(self.path, number, line)
            if self.text_field not in record:
                raise UserError(f"--text-field={self.text_field} is missing from line {number} of {self.path} "
                                f"(its fields: {', '.join(map(str, record))})")
            value = record[self.text_field]
            if value:
                out.append(str(value))
        return out


def open_input(raw: str, text_field: str) -> Input:
    """Check one INPUT of ``data prepare`` and say how to read it (UserError naming the input otherwise)."""
    path = Path(raw).expanduser()
    if path.is_dir():
        if not any((path / m).is_file() for m in SAVED_DATASET_MARKERS):
            raise UserError(f"input {raw} is a folder but not a saved Hugging Face dataset (no dataset_info.json) "
                            "(give jsonl/parquet/text files, or a folder written by Dataset.save_to_disk)")
        columns = _load_saved(path).column_names
        _check_field(path, text_field, columns)
        return Input(path, "saved", text_field)
    if not path.is_file():
        raise UserError(f"input {raw} does not exist (give local files; nothing is downloaded)")
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        return Input(path, "text", text_field)
    if suffix in JSONL_SUFFIXES:
        _check_field(path, text_field, _first_jsonl_fields(path))
        return Input(path, "jsonl", text_field)
    if suffix in PARQUET_SUFFIXES:
        import pyarrow.parquet as pq

        try:
            columns = pq.ParquetFile(path).schema_arrow.names
        except Exception as exc:  # pyarrow raises several types for a file that is not parquet
            raise UserError(f"input {raw} is not a readable parquet file ({type(exc).__name__}) "
                            "(give a parquet file or rename it)") from None
        _check_field(path, text_field, columns)
        return Input(path, "parquet", text_field)
    known = ", ".join(TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES)
    raise UserError(f"input {raw}: cannot tell its format from the suffix {suffix or '(none)'} (use one of {known})")


def _check_field(path: Path, field: str, columns: list[str]) -> None:
    if field not in columns:
        raise UserError(f"--text-field={field} is not a field of {path} (its fields: {', '.join(map(str, columns))}; "
                        "pass --text-field with one of them)")


def _json_record(path: Path, number: int, line: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise UserError(f"input {path} line {number} is not JSON ({exc.msg}) (give one JSON object per line)") from None
    if not isinstance(record, dict):
        raise UserError(f"input {path} line {number} is not a JSON object (give one object per line)")
    return record


def _first_jsonl_fields(path: Path) -> list[str]:
    with path.open(encoding="utf-8") as stream:
        for number, line in enumerate(stream, 1):
            if line.strip():
                return list(_json_record(path, number, line))
    raise UserError(f"input {path} holds no JSON lines (give a file with one JSON object per line)")


def _load_saved(path: Path):

    datasets = offline_datasets()
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets raises several types for a damaged folder
        raise UserError(f"input {path} could not be read as a saved dataset ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:160] if str(exc) else ''}) (give a folder written by "
                        "save_to_disk)") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise UserError(f"input {path} is a DatasetDict without a train split (its splits: {', '.join(ds)}) "
                            "(save the split to prepare as its own dataset)")
        ds = ds["train"]
    return ds


def offline_datasets():
    """Import `datasets` with the hub switched off: local files only, never a network request."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    import datasets

    # The environment is read at import time; an earlier import (e.g. by transformers) would have missed it.
    datasets.config.HF_DATASETS_OFFLINE = True
    datasets.config.HF_HUB_OFFLINE = True
    return datasets
