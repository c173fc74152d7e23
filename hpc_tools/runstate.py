"""The state of a run: one vocabulary, one reader of Slurm's accounting, one classification.

Three words, each defined here once:

- **run state**: the lifecycle state a run's manifest stores (``state``): live ``CREATED``, ``PENDING``,
  ``STARTING``, ``RUNNING``, ``REQUEUED``; terminal ``COMPLETED``, ``FAILED``, ``CANCELLED``, ``TIMEOUT``,
  ``OUT_OF_MEMORY``, ``NODE_FAIL``, ``HANG``, ``PREEMPTED``. ``RunFolder.update`` keeps the first terminal state of a
  life (a requeued job starting again begins a new one), except that Slurm's verdict replaces ``PREEMPTED``, the
  ranks' own report that a signal stopped them.
- **Slurm state**: what sacct prints (``RUNNING``, ``CANCELLED by 0``, ``DEADLINE``, ...); ``SLURM_TO_RUN`` maps every
  one of them onto a run state, so "has the job ended" is one question: ``is_terminal``.
- **status** (with a one-line reason): the run's classification from every source that knows something: sacct, the
  manifest (with the culprit the batch script's epilogue or the hang watchdog named: ``reason``, ``failed_ranks``),
  the hang verdict (``HANG.txt``) and the tails of the logs (``classify``), shown by ``status``,
  ``list`` and ``sweep status``; ``logs -f``, ``cancel`` and ``submit --wait`` ask ``ended`` / ``is_terminal``.

Slurm is asked through one batched, caching reader (``SacctReader``, after submitit's InfoWatcher): one sacct call
for any number of job ids, answers reused for ``max_age_s``, and a missing or failing sacct means "Slurm says nothing"
rather than an error.
"""

from __future__ import annotations

import dataclasses
import glob
import re
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol

# -- a hang's traces (written by the rank's watchdog, ``runtime/watchdog.py``; read here) ------------------------------
HANG_EXIT_CODE = 86
HANG_MARKER = "HANG.txt"  # the one verdict file, in the run folder
HANG_MARKER_GLOB = "HANG*.txt"  # also matches the per-rank HANG-rank<R>.txt files of older runs

# -- run states --------------------------------------------------------------------------------------------------------
LIVE_STATES = ("CREATED", "PENDING", "STARTING", "RUNNING", "REQUEUED")
# A run's life ends in one terminal state; only a live state (a requeued job starting again) can follow it.
TERMINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "HANG", "PREEMPTED")
RUN_STATES = LIVE_STATES + TERMINAL_STATES

# Every state sacct prints (Slurm's base job states and the flag states it shows instead of them) -> run state.
SLURM_TO_RUN = {
    # waiting for resources, or back in the queue
    "PENDING": "PENDING", "CONFIGURING": "PENDING", "POWER_UP_NODE": "PENDING", "REQUEUED": "REQUEUED",
    "REQUEUE_FED": "REQUEUED", "REQUEUE_HOLD": "REQUEUED", "RESV_DEL_HOLD": "PENDING",
    # holding an allocation
    "RUNNING": "RUNNING", "COMPLETING": "RUNNING", "SUSPENDED": "RUNNING", "STOPPED": "RUNNING",
    "RESIZING": "RUNNING", "STAGE_OUT": "RUNNING", "SIGNALING": "RUNNING", "UPDATE_DB": "RUNNING",
    # ended (Slurm's IS_JOB_FINISHED states, and the flag states that end a job)
    "COMPLETED": "COMPLETED", "FAILED": "FAILED", "SPECIAL_EXIT": "FAILED", "LAUNCH_FAILED": "FAILED",
    "RECONFIG_FAIL": "FAILED", "OUT_OF_MEMORY": "OUT_OF_MEMORY", "TIMEOUT": "TIMEOUT", "DEADLINE": "TIMEOUT",
    "NODE_FAIL": "NODE_FAIL", "BOOT_FAIL": "NODE_FAIL", "CANCELLED": "CANCELLED", "REVOKED": "CANCELLED",
    "PREEMPTED": "PREEMPTED",
}

# -- statuses ----------------------------------------------------------------------------------------------------------
STATUSES = ("pending", "running", "completed", "failed", "out_of_memory", "timeout", "hang", "node_failure",
            "preempted", "cancelled")
LIVE_STATUSES = ("pending", "running")
# Most specific first: among terminal verdicts from different sources, the first in this order wins (a hang marker
# explains a FAILED exit, Slurm's CANCELLED explains the ranks' own PREEMPTED report).
SPECIFICITY = ("hang", "out_of_memory", "node_failure", "timeout", "cancelled", "failed", "preempted", "completed")
# The statuses a rerun of "the failures" picks (a cancelled run was stopped on purpose).
FAILURE_STATUSES = ("failed", "out_of_memory", "timeout", "hang", "node_failure")
RUN_TO_STATUS = {
    "CREATED": "pending", "PENDING": "pending", "REQUEUED": "pending", "STARTING": "running", "RUNNING": "running",
    "COMPLETED": "completed", "FAILED": "failed", "CANCELLED": "cancelled", "TIMEOUT": "timeout",
    "OUT_OF_MEMORY": "out_of_memory", "NODE_FAIL": "node_failure", "HANG": "hang", "PREEMPTED": "preempted",
}
# Failures the tail of a log names, most specific first ("CANCELLED AT ... DUE TO TIME LIMIT" is a timeout).
LOG_PATTERNS = (
    ("out_of_memory", re.compile(r"CUDA out of memory|OutOfMemoryError|out-of-memory|oom[-_]kill|Out Of Memory|"
                                 r"\bMemoryError\b", re.I)),
    ("timeout", re.compile(r"DUE TO TIME LIMIT")),
    ("node_failure", re.compile(r"DUE TO NODE FAILURE|NODE_FAIL")),
    ("cancelled", re.compile(r"CANCELLED AT")),
)
LOG_TAIL_BYTES = 64 * 1024
REASON_MAX = 200


def run_state(state: str | None) -> str | None:
    """The run state a run state or a Slurm state string (``CANCELLED by 123``, ``RUNNING+``) stands for, or None."""
    if not state:
        return None
    word = state.split()[0].rstrip("+").upper()
    return word if word in RUN_STATES else SLURM_TO_RUN.get(word)


def is_terminal(state: str | None) -> bool:
    """Whether a run state or a Slurm state means the life has ended: the one terminal test every command uses."""
    return run_state(state) in TERMINAL_STATES


def ended(manifest: dict[str, Any]) -> bool:
    """The run has ended when its own record or Slurm's (``slurm_state``, merged by ``refresh``) says so."""
    return is_terminal(manifest.get("state")) or is_terminal(manifest.get("slurm_state"))


def end_state(manifest: dict[str, Any]) -> str | None:
    """The terminal state to name to a user (the run's own, else Slurm's), or None while the run is live."""
    for key in ("state", "slurm_state"):
        if is_terminal(manifest.get(key)):
            return manifest[key]
    return None


# -- Slurm accounting --------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SlurmJob:
    """One job (or array task) as sacct reports it."""

    job_id: str
    state: str  # sacct's State column as printed, e.g. "CANCELLED by 0"
    exit_code: str = ""
    elapsed: str = ""
    nodelist: str = ""

    @property
    def slurm_state(self) -> str:
        """The state word alone (``CANCELLED``)."""
        return self.state.split()[0].rstrip("+") if self.state else ""

    @property
    def run_state(self) -> str | None:
        return run_state(self.state)

    @property
    def terminal(self) -> bool:
        return is_terminal(self.state)


SACCT_FIELDS = ("JobID", "State", "ExitCode", "Elapsed", "NodeList")


def parse_sacct(text: str) -> dict[str, SlurmJob]:
    """``sacct -X -n -P -o JobID,State,ExitCode,Elapsed,NodeList`` output -> job id -> SlurmJob.

    Pending array tasks are printed as ``123_[4-7%2]``; they are expanded so that ``123_5`` is found.
    """
    jobs: dict[str, SlurmJob] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 3 or not parts[0]:
            continue
        job_id, state, exit_code, elapsed, nodelist = (parts + ["", ""])[:5]
        m = re.match(r"^(\d+)_\[(.+)\]$", job_id)
        if m:
            for task in _expand_ranges(m.group(2).split("%")[0]):
                jobs.setdefault(f"{m.group(1)}_{task}", SlurmJob(f"{m.group(1)}_{task}", state, exit_code, elapsed,
                                                                 nodelist))
        else:
            jobs[job_id] = SlurmJob(job_id, state, exit_code, elapsed, nodelist)
    return jobs


def _expand_ranges(spec: str) -> list[int]:
    out = []
    for part in spec.split(","):
        if "-" in part:
            lo, hi = part.split("-", 1)
            out.extend(range(int(lo), int(hi) + 1))
        elif part.isdigit():
            out.append(int(part))
    return out


def run_sacct(job_ids: list[str], timeout_s: float = 20.0) -> str | None:
    """sacct's answer for these jobs, or None when sacct is missing, refuses or does not answer in time."""
    from hpc_tools import slurm_client

    return slurm_client.sacct(job_ids, SACCT_FIELDS, timeout=timeout_s)


class SacctReader:
    """Job states from sacct, many jobs per call, each answer reused for ``max_age_s`` seconds.

    ``jobs(ids)`` asks sacct once for every id it has no fresh answer for (known or "not in accounting yet"); when
    sacct fails it keeps what it knew before. ``calls`` counts the sacct invocations.
    """

    def __init__(self, max_age_s: float = 2.0, query: Callable[[list[str]], str | None] = run_sacct,
                 clock: Callable[[], float] = time.monotonic):
        self.max_age_s = max_age_s
        self.query = query
        self.clock = clock
        self.calls = 0
        self._cache: dict[str, tuple[float, SlurmJob | None]] = {}

    def jobs(self, job_ids: Iterable[str]) -> dict[str, SlurmJob]:
        """job id -> SlurmJob for the ids sacct knows (ids it does not know are left out)."""
        ids = sorted({str(j) for j in job_ids if j})
        now = self.clock()
        stale = [j for j in ids if j not in self._cache or now - self._cache[j][0] > self.max_age_s]
        if stale:
            self.calls += 1
            text = self.query(stale)
            if text is not None:
                found = parse_sacct(text)
                for j in stale:
                    self._cache[j] = (now, found.get(j))
        return {j: self._cache[j][1] for j in ids if j in self._cache and self._cache[j][1] is not None}

    def job(self, job_id: str) -> SlurmJob | None:
        return self.jobs([job_id]).get(str(job_id))

    def clear(self) -> None:
        self._cache.clear()


READER = SacctReader()  # shared by everything in this process, as submitit shares one InfoWatcher


# -- merging Slurm's view into the manifest ----------------------------------------------------------------------------
class Run(Protocol):
    """What this module needs of a run folder (``hpc_tools.registry.RunFolder``)."""

    path: Path

    @property
    def logs_dir(self) -> Path: ...

    @property
    def records_dir(self) -> Path: ...

    def exists(self) -> bool: ...

    def manifest(self) -> dict[str, Any]: ...

    def update(self, event: str | None = None, soft: bool = False, **fields: Any) -> dict[str, Any]: ...


def on_slurm(manifest: dict[str, Any]) -> bool:
    return manifest.get("executor") in ("slurm", "sbatch") and bool(manifest.get("job_id"))


def refresh(run: Run, job: SlurmJob | None = None, reader: SacctReader | None = None) -> dict[str, Any]:
    """The manifest, with Slurm's view merged in for Slurm runs (asked from ``reader`` unless ``job`` is given).

    A new Slurm state is recorded (``slurm_state``, exit code, elapsed) with an event; a terminal one also becomes the
    run state (``DEADLINE`` -> ``TIMEOUT``, ...), which ``RunFolder.update`` applies only if this life has no terminal
    state yet. Slurm's COMPLETED says only that the batch step exited 0, so the ranks' own report stands for it.
    """
    manifest = run.manifest()
    if not on_slurm(manifest):
        return manifest
    job = job or (reader or READER).job(str(manifest["job_id"]))
    if job is None or not job.state or job.slurm_state == manifest.get("slurm_state"):
        return manifest
    fields: dict[str, Any] = {"slurm_state": job.slurm_state, "slurm_exit_code": job.exit_code,
                              "elapsed": job.elapsed}
    if job.terminal and job.run_state != "COMPLETED":
        fields["state"] = job.run_state
    # soft: a reader on a full or read-only disk still shows Slurm's view, it just cannot keep it
    return run.update(event=f"slurm {job.slurm_state}", soft=True, **fields)


def note_restart(run: Run, restart_count: int, job_id: str | None) -> None:
    """Record, at the start of a requeued life, why the previous one ended when no one recorded it (Slurm requeued
    the job after a node failure, or the batch host died with it): an event ``requeued`` with the previous life's
    end from the manifest, else from Slurm's accounting of that life (``sacct --duplicates``)."""
    manifest = run.manifest()
    starts = [e for e in manifest.get("events", []) if e.get("event") == "started"]
    if not starts or restart_count <= int(starts[-1].get("restart_count") or 0):
        return
    since = manifest["events"][manifest["events"].index(starts[-1]) + 1:]
    if any(e.get("state") == "REQUEUED" or e.get("event") in ("resume requested", "restarting") for e in since):
        return  # the job requeued itself (time limit), restarted its step (cluster.restarts), or `hpc_tools resume`
        # started this life: already recorded
    ended = next((e for e in reversed(since) if is_terminal(e.get("state"))), None)
    if ended:
        after = f"{ended['state']}" + (f": {ended['reason']}" if ended.get("reason") else "")
    else:
        previous = previous_life_state(job_id) if job_id else None
        after = f"Slurm {previous}" if previous else "no record (the batch host may have failed)"
    run.update(event="requeued", requeued_after=_line(after), restart_count=restart_count, soft=True)


def previous_life_state(job_id: str, timeout_s: float = 10.0) -> str | None:
    """Slurm's state of the life before this one of a requeued job (``NODE_FAIL``, ...), or None."""
    from hpc_tools import slurm_client

    text = slurm_client.sacct([job_id], ("JobID", "State"), duplicates=True, timeout=timeout_s) or ""
    states = [line.split("|")[1] for line in text.splitlines() if line.count("|") >= 1 and
              line.split("|")[0] == job_id]
    return states[-2] if len(states) >= 2 else None


def refresh_all(runs: list[Run], reader: SacctReader | None = None) -> list[tuple[dict[str, Any], SlurmJob | None]]:
    """``refresh`` for many runs with one sacct call; (manifest, Slurm's job or None) per run, in order."""
    manifests = [run.manifest() if run.exists() else {} for run in runs]
    ids = [str(m["job_id"]) for m in manifests if on_slurm(m)]
    found = (reader or READER).jobs(ids) if ids else {}
    out = []
    for run, manifest in zip(runs, manifests):
        job = found.get(str(manifest.get("job_id"))) if on_slurm(manifest) else None
        out.append((refresh(run, job) if job else manifest, job))
    return out


def wait(run: Run, poll_s: float = 2.0, reader: SacctReader | None = None) -> dict[str, Any]:
    """Poll until Slurm says the job ended (the ranks' COMPLETED comes before the job has left Slurm); the manifest."""
    while True:
        manifest = refresh(run, reader=reader)
        if is_terminal(manifest.get("slurm_state")):
            return manifest
        time.sleep(poll_s)


# -- what a run left behind --------------------------------------------------------------------------------------------
def last_step(run: Run) -> dict | None:
    """The newest step record of rank 0 (the tail of its JSON-lines file, not the whole file)."""
    import json

    from profiling.records import jsonl_path

    path = jsonl_path(run.records_dir, 0)
    if not path.is_file():
        return None
    with open(path, "rb") as f:
        f.seek(0, 2)
        f.seek(max(f.tell() - 8192, 0))
        lines = [ln for ln in f.read().splitlines() if ln.strip()]
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None


def log_files(run: Run, rank: int | None = None) -> list[Path]:
    """A run's log files in the order they were written: one rank's (``rank``), or every log it has (None).

    Local runs write ``logs/rank<R>.out``; submitit runs per-task files named by the manifest's ``log_glob``; a plain
    ``sbatch`` job one batch log for all ranks (``batch_log``).
    """
    manifest = run.manifest()
    if rank is None:
        found = sorted(p for p in run.logs_dir.glob("*") if p.is_file()) if run.logs_dir.is_dir() else []
        if manifest.get("log_glob"):
            found += [Path(p) for p in sorted(glob.glob(manifest["log_glob"]))]
        if manifest.get("batch_log") and Path(manifest["batch_log"]).is_file():
            found.append(Path(manifest["batch_log"]))
        return list(dict.fromkeys(found))
    local = run.logs_dir / f"rank{rank:05d}.out"
    if local.is_file():
        return [local]
    if manifest.get("log_glob"):
        return [Path(p) for p in sorted(glob.glob(manifest["log_glob"])) if f"_{rank}_log." in Path(p).name]
    if manifest.get("batch_log") and Path(manifest["batch_log"]).is_file():
        return [Path(manifest["batch_log"])]
    return sorted(run.logs_dir.glob("*.out"))


def hang_markers(run: Run) -> list[Path]:
    """The hang watchdog's verdict file ``HANG.txt`` (and older runs' ``HANG-rank<R>.txt``) in the run folder."""
    return sorted(run.path.glob(HANG_MARKER_GLOB))


# -- classification ----------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Verdict:
    """A run's status and the one line that explains it."""

    status: str
    reason: str

    def as_dict(self) -> dict[str, str]:
        return {"status": self.status, "reason": self.reason}


def _line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= REASON_MAX else text[:REASON_MAX - 3] + "..."


def from_slurm(job: SlurmJob | None) -> Verdict | None:
    """Slurm's verdict on a job; exit code 86 (the hang watchdog) is a hang."""
    if job is None or not job.run_state:
        return None
    code = job.exit_code if job.exit_code not in ("", "0:0") else ""
    if code.split(":")[0] == str(HANG_EXIT_CODE):
        return Verdict("hang", f"Slurm {job.state}, exit code {code} (the hang watchdog)")
    status = RUN_TO_STATUS[job.run_state]
    if status == "running":
        where = f" on {job.nodelist}" if job.nodelist and job.nodelist != "None assigned" else ""
        return Verdict(status, f"Slurm {job.state}{where}" + (f", elapsed {job.elapsed}" if job.elapsed else ""))
    detail = (f", exit code {code}" if code else "") + (f" after {job.elapsed}" if job.terminal and job.elapsed else "")
    return Verdict(status, f"Slurm {job.state}{detail}")


def from_manifest(manifest: dict[str, Any] | None) -> Verdict | None:
    """The run's own record: its state, exit code, error and whether a cancel was asked for."""
    if not manifest:
        return None
    state = run_state(manifest.get("state"))
    if manifest.get("exit_code") == HANG_EXIT_CODE or state == "HANG":
        return Verdict("hang", manifest.get("reason") or
                       f"a rank exited with code {HANG_EXIT_CODE} (the hang watchdog)")
    if state is None:
        return None
    status = RUN_TO_STATUS[state]
    if status == "preempted" and manifest.get("cancel_requested"):
        return Verdict("cancelled", f"cancel requested at {manifest['cancel_requested']}; the ranks stopped"
                       + (f" after step {manifest['last_step']}" if manifest.get("last_step") is not None else ""))
    reasons = {
        "pending": "submitted, waiting for Slurm" if manifest.get("job_id") else "created, not started",
        "running": f"running since {manifest.get('started') or manifest.get('batch_started') or '?'}"
                   + (f" (restart {manifest['restart_count']})" if manifest.get("restart_count") else ""),
        "completed": f"finished at {manifest.get('ended') or '?'}",
        "preempted": "stopped by a signal" + (f" after step {manifest['last_step']}"
                                              if manifest.get("last_step") is not None else "") + ", not requeued",
        "cancelled": f"cancelled (cancel requested at {manifest['cancel_requested']})"
                     if manifest.get("cancel_requested") else "cancelled",
    }
    default = f"exit code {manifest['exit_code']}" if manifest.get("exit_code") else ""  # else Slurm's reason says it
    reason = manifest.get("error") if status == "failed" and manifest.get("error") else reasons.get(status, default)
    if status not in LIVE_STATUSES and manifest.get("reason"):  # the culprit, named by the epilogue or the watchdog
        reason = manifest["reason"] + (f" ({manifest['error']})" if manifest.get("error") and
                                       manifest["error"] not in manifest["reason"] else "")
    return Verdict(status, reason)


def from_hang_markers(markers: list[Path]) -> Verdict | None:
    """The watchdog's verdict: the first line of ``HANG.txt`` (culprit and waiting ranks), or of the first
    ``HANG-rank<R>.txt`` an older run left."""
    if not markers:
        return None
    verdict = next((m for m in markers if m.name == HANG_MARKER), None)
    first_marker = verdict or markers[0]
    try:
        first = first_marker.read_text(errors="replace").splitlines()[0]
    except (OSError, IndexError):
        first = "no step completed in time"
    if verdict is not None:
        return Verdict("hang", first)
    more = f" (and {len(markers) - 1} more rank(s))" if len(markers) > 1 else ""
    return Verdict("hang", f"{markers[0].name}: {first}{more}")


def log_tail(path: Path, nbytes: int = LOG_TAIL_BYTES) -> str | None:
    """The last ``nbytes`` of a log as text (undecodable bytes replaced), or None when it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(f.tell() - nbytes, 0))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return None


# Lines that begin one life of the job in its batch log: the rendered script's open_run step, submitit's task start, an
# in-job restart's new step (``hpc_tools.job.restarts``).
LIFE_START = re.compile(r"^hpc_tools: run folder |submitit INFO .*Starting with JobEnvironment|^hpc_tools: restart ",
                        re.M)


def this_life(text: str) -> str:
    """The part of a log written by the latest life of the job (requeued jobs append to the same log)."""
    starts = list(LIFE_START.finditer(text))
    return text[starts[-1].start():] if starts else text


def from_logs(paths: Iterable[Path]) -> Verdict | None:
    """The most specific failure the tail of any log names (the matching line is the reason), or None. Only the
    latest life's part of a log counts (``this_life``): a requeued job's culprit comes from its own evidence, not
    from an out-of-memory or node failure line an earlier life left in the same batch log."""
    found: dict[str, str] = {}
    for path in paths:
        text = log_tail(path)
        if text is None:
            continue
        text = this_life(text)
        for status, pattern in LOG_PATTERNS:  # most specific first: one verdict per file
            m = pattern.search(text)
            if m:
                start, end = text.rfind("\n", 0, m.start()) + 1, text.find("\n", m.end())
                found.setdefault(status, f"{Path(path).name}: {text[start:end if end >= 0 else None].strip()}")
                break
    status = next((s for s in SPECIFICITY if s in found), None)
    return Verdict(status, found[status]) if status else None


def combine(*verdicts: Verdict | None) -> Verdict:
    """One verdict from several sources' (None = that source knows nothing): a terminal verdict beats a live one
    (sacct may still say RUNNING while the manifest says COMPLETED, or the manifest RUNNING for a killed rank), and
    among terminal verdicts the most specific wins. The reasons of the sources that agree are joined."""
    known = [v for v in verdicts if v]
    terminal = [v for v in known if v.status not in LIVE_STATUSES]
    if terminal:
        status = next(s for s in SPECIFICITY if any(v.status == s for v in terminal))
    elif any(v.status == "running" for v in known):
        status = "running"
    elif known:
        status = "pending"
    else:
        return Verdict("pending", "no record of this run yet")
    reasons = list(dict.fromkeys(v.reason for v in known if v.status == status and v.reason))
    return Verdict(status, _line("; ".join(reasons) or f"recorded as {status}"))


def classify(run: Run | None, job: SlurmJob | None = None, manifest: dict[str, Any] | None = None) -> Verdict:
    """The run's status and reason from Slurm's ``job`` (if any), its manifest, hang markers and logs.

    A plain failure (or a cancel / stop signal that srun or Slurm sent after a rank died) is explained by a more
    specific failure the logs name: an OOM, a node failure, the time limit.
    """
    if run is None or not run.exists():
        return combine(from_slurm(job))
    manifest = manifest if manifest is not None else run.manifest()
    slurm, own = from_slurm(job), from_manifest(manifest)
    # a culprit named in the manifest (the epilogue's or the watchdog's reason) reads first, Slurm's words after it
    verdict = combine(from_hang_markers(hang_markers(run)), *((own, slurm) if manifest.get("reason") else (slurm, own)))
    if verdict.status in ("failed", "cancelled", "preempted"):
        logged = from_logs(log_files(run))
        if logged and logged.status in ("out_of_memory", "node_failure", "timeout"):
            return Verdict(logged.status, _line(logged.reason))
    return verdict
