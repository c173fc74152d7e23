"""Per-rank record files: JSON lines appended during the run, a parquet file per rank at the end.

The one owner of the record file names (``records/rank<R>.jsonl``, ``rank<R>.parquet``, ``comm_rank<R>.jsonl``) and of
reading them back; every reader (the run summary, ``analyze``, the calibration) finds and reads them through here.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from profiling.schema import FIELD_NAMES, arrow_schema, validate_record

if TYPE_CHECKING:
    import numpy as np

_RANK_FILE_RE = re.compile(r"^rank(\d+)\.(parquet|jsonl)$")


def jsonl_path(records_dir: Path, rank: int) -> Path:
    return Path(records_dir) / f"rank{rank:05d}.jsonl"


def parquet_path(records_dir: Path, rank: int) -> Path:
    return Path(records_dir) / f"rank{rank:05d}.parquet"


def comm_path(records_dir: Path, rank: int) -> Path:
    """Sampled collectives of one rank: one JSON line per (step, kind, group size), see ``profiling.comm``."""
    return Path(records_dir) / f"comm_rank{rank:05d}.jsonl"


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


def rank_files(records_dir: Path) -> dict[int, Path]:
    """rank -> its step-record file to read: the parquet, unless the JSON lines are newer (a job killed after a
    requeue appended to them) or alone (a rank killed before compacting)."""
    found: dict[int, dict[str, Path]] = {}
    records_dir = Path(records_dir)
    if not records_dir.is_dir():
        return {}
    for path in records_dir.iterdir():
        m = _RANK_FILE_RE.match(path.name)
        if m:
            found.setdefault(int(m.group(1)), {})[m.group(2)] = path
    out = {}
    for rank, kinds in found.items():
        pq_path, js_path = kinds.get("parquet"), kinds.get("jsonl")
        if pq_path and (js_path is None or pq_path.stat().st_mtime >= js_path.stat().st_mtime):
            out[rank] = pq_path
        else:
            out[rank] = js_path
    return dict(sorted(out.items()))


def read_columns(path: Path, columns: Iterable[str]) -> dict[str, "np.ndarray"]:
    """The named columns of one rank file as float64 arrays in file order; absent optional columns are missing from
    the result and nulls are NaN."""
    import numpy as np

    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        present = set(pf.schema_arrow.names)
        names = [c for c in columns if c in present]
        table = pf.read(columns=names)
        return {c: table.column(c).to_numpy(zero_copy_only=False).astype(np.float64, copy=False) for c in names}
    rows = list(read_jsonl(path))
    present = [c for c in columns if any(c in r for r in rows[:1] + rows[-1:])]
    return {c: np.array([np.nan if r.get(c) is None else r[c] for r in rows], dtype=np.float64) for c in present}


def read_comm_rows(records_dir: Path, rank: int) -> list[dict[str, Any]]:
    """This rank's sampled-collective rows (none when communication was not sampled)."""
    path = comm_path(records_dir, rank)
    return list(read_jsonl(path)) if path.is_file() else []
