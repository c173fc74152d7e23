"""Per-rank record files: JSON lines appended during the run, a parquet file per rank at the end."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

from profiling.schema import FIELD_NAMES, arrow_schema, validate_record


def jsonl_path(records_dir: Path, rank: int) -> Path:
    return Path(records_dir) / f"rank{rank:05d}.jsonl"


def parquet_path(records_dir: Path, rank: int) -> Path:
    return Path(records_dir) / f"rank{rank:05d}.parquet"


class RecordWriter:
    """Appends validated step records to this rank's JSON-lines file (a requeued job appends, never truncates).

    Validation is a third of a record's cost, and the fields a collector writes are fixed by its code, so only the
    first records and then every ``validate_every``-th are checked (``validate_every=1`` checks all).
    """

    def __init__(self, records_dir: Path, rank: int, validate: bool = True, validate_every: int = 100):
        self.records_dir = Path(records_dir)
        self.records_dir.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.validate = validate
        self.validate_every = validate_every
        self._written = 0
        self._f = open(jsonl_path(self.records_dir, rank), "a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        if self.validate and (self._written < 3 or self._written % self.validate_every == 0):
            validate_record(record)
        self._written += 1
        self._f.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self, compact: bool = True) -> None:
        if self._f.closed:
            return
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        if compact:
            compact_rank(self.records_dir, self.rank)


def read_jsonl(path: Path) -> Iterable[dict[str, Any]]:
    """Records of one JSON-lines file; a torn last line (killed mid-write) is skipped."""
    with open(path) as f:
        for line in f:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def compact_rank(records_dir: Path, rank: int) -> Path:
    """Rewrite this rank's JSON lines as parquet (written to a temporary name, then renamed)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = list(read_jsonl(jsonl_path(records_dir, rank)))
    schema = arrow_schema()
    table = pa.Table.from_pylist([{k: r.get(k) for k in FIELD_NAMES} for r in rows], schema=schema)
    out = parquet_path(records_dir, rank)
    tmp = out.with_suffix(".parquet.tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, out)
    return out
