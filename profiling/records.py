"""Per-rank record files: JSON lines appended during the run, a parquet file per rank at the end.

The one owner of the record file names (``records/rank<R>.jsonl``, ``rank<R>.parquet``, ``comm_rank<R>.jsonl``,
``events_rank<R>.jsonl``) and of reading them back; every reader (the run summary, ``analyze``, the calibration,
goodput) finds and reads them through here.
"""

from __future__ import annotations

import functools
import json
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from profiling.schema import FIELD_NAMES, arrow_schema, fields, validate_record

if TYPE_CHECKING:
    import numpy as np

_RANK_FILE_RE = re.compile(r"^rank(\d+)\.(parquet|jsonl)$")
# How many rank files iter_rank_columns reads ahead of its caller (each a few columns x the rank's steps: ~13 MB per
# 100k steps). A pyarrow dataset scan was tried first: behind a caller that reduces each file it buffered ~1 GB of a
# 100M-record run, whatever its readahead settings; a fixed number of file reads in flight bounds it.
READAHEAD_FILES = 2


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

    Buffered, off the step's critical path: records are written (one ``write`` call, no fsync) every
    ``flush_every_s`` seconds or ``flush_every`` records, whichever comes first, on ``flush()`` (the collector
    calls it around checkpoint saves, so a checkpoint's steps are always on disk) and at ``close``. A rank killed
    without a chance to close (SIGKILL) loses at most the records since the last flush; an exception or a stop
    signal closes the writer and loses none.
    """

    def __init__(self, records_dir: Path, rank: int, validate: bool = True, validate_every: int = 100,
                 flush_every: int = 100, flush_every_s: float = 2.0):
        self.records_dir = Path(records_dir)
        self.records_dir.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.validate = validate
        self.validate_every = validate_every
        self.flush_every, self.flush_every_s = flush_every, flush_every_s
        self._written = 0
        self._buffer: list[dict[str, Any]] = []
        self._flushed_at = time.monotonic()
        self._f = open(jsonl_path(self.records_dir, rank), "a")

    def write(self, record: dict[str, Any]) -> None:
        if self.validate and (self._written < 3 or self._written % self.validate_every == 0):
            validate_record(record)
        self._written += 1
        self._buffer.append(record)
        if len(self._buffer) >= self.flush_every or time.monotonic() - self._flushed_at >= self.flush_every_s:
            self.flush()

    def flush(self) -> None:
        """Write the buffered records to the file (whole lines, in one write: a kill leaves at most a torn last
        line, which readers skip)."""
        self._flushed_at = time.monotonic()
        if not self._buffer or self._f.closed:
            return
        text = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in self._buffer)
        self._buffer = []
        self._f.write(text)
        self._f.flush()

    def close(self, compact: bool = True) -> None:
        if self._f.closed:
            return
        self.flush()
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

    rows = list(read_jsonl(jsonl_path(records_dir, rank)))
    schema = arrow_schema()
    table = pa.Table.from_pylist([{k: r.get(k) for k in FIELD_NAMES} for r in rows], schema=schema)
    out = parquet_path(records_dir, rank)
    tmp = out.with_suffix(".parquet.tmp")
    write_parquet(table, tmp)
    os.replace(tmp, out)
    return out


# How step records are encoded in parquet (every writer of rank files goes through ``write_parquet``): a dictionary for
# the fields that hold few values in a rank's file (identity, per-job constants, strings, memory plateaus), delta
# encoding for the step counter, plain for the per-step measurements. Measured on 10k-record files: their distinct
# floats decode ~20 % faster plain than through a 10k-entry dictionary, and the step 4x faster delta-encoded.
DICTIONARY_FIELDS = fields("schema_version", "run_id", "job_id", "restart", "rank", "node", "tp_rank", "pp_rank",
                           "dp_rank", "tokens", "model_flops", "hardware_flops", "mem_allocated_max_bytes",
                           "mem_reserved_max_bytes", "comm_bytes")
DELTA_FIELDS = fields("step")


def write_parquet(table, path: Path) -> None:
    """Write a table of step records (``arrow_schema`` columns, or some of them) as one rank's parquet file."""
    import pyarrow.parquet as pq

    names = set(table.column_names)
    pq.write_table(table, path, use_dictionary=[c for c in DICTIONARY_FIELDS if c in names],
                   column_encoding={c: "DELTA_BINARY_PACKED" for c in DELTA_FIELDS if c in names})


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
        return {c: np.concatenate([_float64_values(ch) for ch in table.column(c).chunks] or [np.empty(0)])
                for c in names}
    rows = list(read_jsonl(path))
    present = [c for c in columns if any(c in r for r in rows[:1] + rows[-1:])]
    return {c: np.array([np.nan if r.get(c) is None else r[c] for r in rows], dtype=np.float64) for c in present}


def iter_rank_columns(records_dir: Path, columns: Iterable[str]) -> Iterator[tuple[int, dict[str, "np.ndarray"]]]:
    """(rank, columns) for every rank file of ``rank_files``, in rank order, as ``read_columns`` gives them: float64
    arrays in file order, nulls NaN, a column the file lacks (or holds only nulls) left out.

    Streamed: the parquet files are read with column projection by Arrow's threads up to ``READAHEAD_FILES`` files
    ahead of the caller, who reduces one rank while the next ones are read and decoded; memory holds those few files,
    however many ranks and steps the run has. JSON-lines files (a rank killed before it compacted) are read in their
    place in the rank order.
    """
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    columns = list(columns)
    with ThreadPoolExecutor(max_workers=READAHEAD_FILES, thread_name_prefix="records") as pool:
        ahead: deque = deque()  # (rank, future) of the files being read, in rank order
        for rank, path in rank_files(records_dir).items():
            if len(ahead) > READAHEAD_FILES:
                done_rank, future = ahead.popleft()
                yield done_rank, future.result()
            read = _parquet_columns if path.suffix == ".parquet" else _jsonl_columns
            ahead.append((rank, pool.submit(read, path, columns)))
        while ahead:
            done_rank, future = ahead.popleft()
            yield done_rank, future.result()


def _jsonl_columns(path: Path, columns: list[str]) -> dict[str, "np.ndarray"]:
    import numpy as np

    return {c: v for c, v in read_columns(path, columns).items() if not np.all(np.isnan(v))}


def _parquet_columns(path: Path, columns: list[str]) -> dict[str, "np.ndarray"]:
    """One parquet rank file's wanted columns (projection: the others are never decoded). The footer's statistics
    answer two kinds of column without decoding them: one holding only nulls (left out, as ``_table_columns`` would)
    and an integer one holding one value (restart, pp_rank, tokens of most runs: a read-only stride-0 view of it,
    ``is_constant``).

    Reads through ``pyarrow.parquet.ParquetReader`` (what ``ParquetFile`` wraps, without its per-file Python set-up):
    the analysis reads thousands of files from threads, and the Python work per file, which holds the GIL, is what
    limits it on few cores."""
    import numpy as np
    from pyarrow.parquet import ParquetReader

    reader = ParquetReader()
    reader.open(str(path))
    try:
        meta = reader.metadata
        if meta.num_rows == 0:
            return {}
        groups = [meta.row_group(g) for g in range(meta.num_row_groups)]
        known: dict[str, Any] = {}  # column -> None (only nulls) or its one value
        decode: dict[str, int] = {}  # column -> its index in the file
        for c in columns:
            try:
                i = reader.column_name_idx(c)
            except KeyError:  # a file of an older schema
                continue
            found = _chunk_facts(groups, i, c)
            if found is _UNKNOWN:
                decode[c] = i
            else:
                known[c] = found
        out = _table_columns(reader.read_all(column_indices=list(decode.values()), use_threads=False)) if decode else {}
    finally:
        reader.close()
    for c, value in known.items():
        if value is not None:  # one value, no copies of it: a read-only view with stride 0 (``is_constant``)
            one = np.ndarray((meta.num_rows,), dtype=np.float64, buffer=np.array([float(value)]), strides=(0,))
            one.flags.writeable = False
            out[c] = one
    return {c: out[c] for c in columns if c in out}  # the caller's column order


def is_constant(values: "np.ndarray") -> bool:
    """True for a column the reader knows holds one value (``_parquet_columns`` gives it as a stride-0 view): its
    reductions are its first value, without a pass over it."""
    return values.ndim == 1 and values.size > 1 and values.strides[0] == 0


_UNKNOWN = object()
_INTEGER = ("INT32", "INT64")


def _chunk_facts(groups: list, i: int, name: str) -> Any:
    """What column ``i`` (``name``)'s statistics prove in every row group (``groups``: the file's row-group metadata):
    None (only nulls), the one integer value it holds, or ``_UNKNOWN`` (decode it). Float statistics are never taken
    for a value: they skip NaN."""
    value = _UNKNOWN
    for g, group in enumerate(groups):
        chunk = group.column(i)
        stats = chunk.statistics
        if stats is None or not stats.has_null_count or chunk.path_in_schema != name:  # (a flat column, as written)
            return _UNKNOWN
        nulls = stats.null_count
        if nulls == chunk.num_values:
            here = None
        elif (nulls == 0 and chunk.physical_type in _INTEGER and stats.has_min_max and stats.min == stats.max
              and type(stats.min) is int):  # a plain integer (not a date or time stored as one)
            here = stats.min
        else:
            return _UNKNOWN
        if g and here != value:
            return _UNKNOWN
        value = here
    return value


def _table_columns(table) -> dict[str, "np.ndarray"]:
    """A table's columns as float64 arrays; all-null columns left out (the figures read them as absent)."""
    import numpy as np

    out = {}
    for name, column in zip(table.column_names, table.columns):
        if column.null_count == len(column):
            continue
        arrays = [_float64_values(chunk) for chunk in column.chunks]
        out[name] = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
    return out


def _float64_values(array) -> "np.ndarray":
    """A numeric Arrow array as float64, nulls NaN, read from its buffers: ``Array.to_numpy`` (and any Arrow scalar
    made from a Python float, e.g. for ``fill_null``) imports pandas (a third of a second), which `status` must not
    pay for a scan of the records. Integers are converted by numpy (Arrow's safe cast checks every value for precision
    loss first: several times slower)."""
    import numpy as np
    import pyarrow as pa

    dtype = _numpy_dtype(str(array.type))
    if dtype is None:  # e.g. bool: bit-packed
        array = array.cast(pa.float64())
        dtype = np.dtype(np.float64)
    validity, data = array.buffers()[:2]
    values = np.frombuffer(data, dtype=dtype, count=len(array), offset=array.offset * dtype.itemsize)
    converted = dtype != np.float64
    if converted:
        values = values.astype(np.float64)
    if array.null_count and validity is not None:
        valid = np.unpackbits(np.frombuffer(validity, dtype=np.uint8), bitorder="little")
        if not converted:
            values = values.copy()  # float64 is a read-only view of Arrow's buffer: copied to write its NaNs
        values[valid[array.offset:array.offset + len(array)] == 0] = np.nan
    return values


@functools.lru_cache(maxsize=None)
def _numpy_dtype(arrow_type: str) -> "np.dtype | None":
    """The numpy dtype whose buffer layout an Arrow numeric type shares (None: not one of them, e.g. bool)."""
    import numpy as np

    known = {"double": np.float64, "float": np.float32, "int64": np.int64, "int32": np.int32, "int16": np.int16,
             "int8": np.int8, "uint64": np.uint64, "uint32": np.uint32, "uint16": np.uint16, "uint8": np.uint8}
    return np.dtype(known[arrow_type]) if arrow_type in known else None


def read_comm_rows(records_dir: Path, rank: int) -> list[dict[str, Any]]:
    """This rank's sampled-collective rows (none when communication was not sampled)."""
    path = comm_path(records_dir, rank)
    return list(read_jsonl(path)) if path.is_file() else []


def first_value(records_dir: Path, rank: int, column: str) -> Any:
    """``column`` of this rank's first step record (e.g. its ``node``), or None."""
    path = rank_files(records_dir).get(rank)
    if path is None:
        return None
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        if column not in pf.schema_arrow.names or pf.metadata.num_rows == 0:
            return None
        return pf.read_row_group(0, columns=[column]).column(column)[0].as_py()
    return next((r.get(column) for r in read_jsonl(path)), None)


def events_path(records_dir: Path, rank: int) -> Path:
    """Timed events of one rank outside the steps (its start, checkpoint saves and loads): one JSON line each,
    appended across restarts (``profiling.collector.StepCollector.event`` writes them, ``profiling.goodput`` reads)."""
    return Path(records_dir) / f"events_rank{rank:05d}.jsonl"


def read_events(records_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """rank -> its events, in file order (ranks without an events file are absent)."""
    out: dict[int, list[dict[str, Any]]] = {}
    records_dir = Path(records_dir)
    if not records_dir.is_dir():
        return out
    for path in sorted(records_dir.glob("events_rank*.jsonl")):
        m = re.match(r"^events_rank(\d+)\.jsonl$", path.name)
        if m:
            out[int(m.group(1))] = list(read_jsonl(path))
    return out
