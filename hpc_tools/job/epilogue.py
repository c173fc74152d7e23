"""``python -m hpc_tools.job.epilogue --run-dir RUN --exit-code N``: the batch script's last step, after srun.

The batch script outlives its ranks, so it is where a run's end is recorded whatever killed them (a rank, rank 0,
a whole node, a full disk), within seconds and without anyone running ``status``. Both launch paths run it: the
rendered sbatch script after its ``srun`` line, and submitit's script as its teardown; the local executor calls
``record_end`` with the exit codes it saw.

Evidence, most direct first:

- srun's own report of this life (``srun: error: n2: task 2: Killed``, ``... Node failure on n2``) in the batch
  log: the first failing task(s) srun names are the culprits (the rest were stopped by ``--kill-on-bad-exit``);
- the ranks' heartbeats (``hpc_tools.runtime.heartbeat``): each rank's node and last step, and for a rank that
  exited through Python its exit code and error (a rank killed by a signal leaves no exit record);
- the tails of the logs, for the failure class (out of memory, node failure) through ``hpc_tools.runstate``.

The manifest then gets, through ``RunFolder.update`` (the first terminal state of a life stands, so a HANG or
COMPLETED the ranks recorded is kept): ``state``, ``exit_code``, ``failed_ranks``, ``failed_nodes``, ``reason``
("rank 2 on n2 was killed by signal 9 (Killed) after step 48") and an event ``batch ended``. The latest life's
outcome wins: a requeued life that completes clears the culprit and error an earlier life left, and a failing one
replaces them; each life's outcome is kept, oldest first, in the manifest's ``lives`` (``status`` shows the earlier
ones).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hpc_tools.registry import RunFolder, now_iso
from hpc_tools.runstate import HANG_EXIT_CODE, from_logs, is_terminal, log_files, log_tail, this_life
from hpc_tools.runtime import heartbeat
from hpc_tools.runtime.distenv import restart_count
from hpc_tools.runtime.heartbeat import Beat, ranks_text

# srun's messages about its tasks (Slurm's srun/launch code): "srun: error: n2: task 2: Killed",
# "srun: error: n1: tasks 0-1: Exited with exit code 3", "srun: error: Node failure on n2".
SRUN_TASK = re.compile(r"^srun: error: (?P<node>\S+): tasks? (?P<tasks>[\d,\-]+): (?P<what>.+?)\s*$", re.M)
SRUN_NODE_FAIL = re.compile(r"^srun: error: Node failure on (?P<node>\S+)", re.M)
EXITED = re.compile(r"Exited with exit code (\d+)")
LOG_TAIL_BYTES = 256 * 1024
SIGNAL_BY_TEXT = {signal.strsignal(s): int(s) for s in signal.Signals if signal.strsignal(s)}


@dataclass
class TaskFailure:
    """One failure report: the ranks, their node, and how they ended (``signal`` or ``code``)."""

    ranks: list[int]
    node: str | None = None
    signal: int | None = None
    code: int | None = None
    text: str = ""  # srun's words ("Killed"), or the Python error
    node_failure: bool = False


@dataclass
class Ending:
    """What the epilogue records: the run state it proposes and the fields that explain it."""

    state: str | None
    exit_code: int
    reason: str = ""
    failed_ranks: list[int] = field(default_factory=list)
    failed_nodes: list[str] = field(default_factory=list)


def failures_from_exit_codes(codes: dict[int, int]) -> list[TaskFailure]:
    """The local launcher's knowledge (rank -> Popen return code of the first failing ranks, seen in one poll) as
    failure reports; deaths by a signal first (a peer's death makes the others raise, not the reverse)."""
    by_code: dict[int, list[int]] = {}
    for rank, rc in sorted(codes.items(), key=lambda item: (item[1] >= 0, item[0])):
        by_code.setdefault(rc, []).append(rank)
    return [TaskFailure(ranks=ranks, signal=-rc if rc < 0 else None, code=rc if rc >= 0 else None,
                        text=signal.strsignal(-rc) or "" if rc < 0 else "") for rc, ranks in by_code.items()]


def expand_tasks(spec: str) -> list[int]:
    """srun's task list ("0-1,3") -> [0, 1, 3]."""
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit():
            out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def srun_failures(text: str) -> list[TaskFailure]:
    """srun's failure reports in ``text``, in the order srun printed them (the first is the first failure)."""
    found: list[tuple[int, TaskFailure]] = []
    for m in SRUN_TASK.finditer(text):
        what = m.group("what")
        code = EXITED.search(what)
        sig = SIGNAL_BY_TEXT.get(what.replace(" (core dumped)", ""))
        found.append((m.start(), TaskFailure(ranks=expand_tasks(m.group("tasks")), node=m.group("node"),
                                             code=int(code.group(1)) if code else None, signal=sig, text=what)))
    for m in SRUN_NODE_FAIL.finditer(text):
        found.append((m.start(), TaskFailure(ranks=[], node=m.group("node"), text="node failure", node_failure=True)))
    return [f for _, f in sorted(found, key=lambda pair: pair[0])]


def read_srun_reports(run: RunFolder) -> list[TaskFailure]:
    """srun's reports of this life, from every log of the run (the batch log, submitit's task-0 stderr)."""
    failures: list[TaskFailure] = []
    for path in log_files(run):
        text = log_tail(path, LOG_TAIL_BYTES)
        if text is not None:
            failures += srun_failures(this_life(text))
    return failures


def from_heartbeats(beats: dict[int, Beat], world_size: int | None) -> list[TaskFailure]:
    """Failures the heartbeats show when srun said nothing: the first rank(s) to exit with an error (by time), else
    the ranks that left no exit record (killed by a signal), else ranks that never started."""
    errored = sorted((b for b in beats.values() if b.exit and b.exit.get("code")), key=lambda b: b.exit["time"])
    if errored:
        first = errored[0].exit["time"]
        return [TaskFailure(ranks=[b.rank], node=b.node, code=b.exit["code"], text=b.exit.get("error") or "")
                for b in errored if b.exit["time"] - first < 1.0]
    silent = sorted(r for r, b in beats.items() if not b.exit)
    if silent:
        return [TaskFailure(ranks=silent, text="ended without an exit record (killed by a signal?)")]
    missing = [r for r in range(world_size or 0) if r not in beats]
    return [TaskFailure(ranks=missing, text="never started")] if missing else []


def describe(failure: TaskFailure, beats: dict[int, Beat]) -> str:
    """"rank 2 on n2 was killed by signal 9 (Killed) after step 48", with the rank's Python error if it left one."""
    ranks = failure.ranks
    node = failure.node or next((beats[r].node for r in ranks if r in beats), None)
    who = ranks_text(ranks) if ranks else "the ranks"
    where = f" on {node}" if node else ""
    if failure.node_failure:
        how = "were lost with their node" if ranks else "failed"
        who = who if ranks else "node"
        return f"{who}{where} {how} (srun: node failure)" if ranks else f"node {node} failed (srun: node failure)"
    if failure.signal is not None:
        how = f"{'was' if len(ranks) == 1 else 'were'} killed by signal {failure.signal} ({failure.text})"
    elif failure.code is not None:
        how = f"exited with code {failure.code}"
    else:
        how = failure.text or "failed"
    steps = sorted({beats[r].step for r in ranks if r in beats})
    after = f" after step {steps[0]}" if len(steps) == 1 else (f" after steps {steps[0]}-{steps[-1]}" if steps else "")
    errors = [beats[r].exit.get("error") for r in ranks if r in beats and beats[r].exit and beats[r].exit.get("error")]
    detail = f": {errors[0]}" if errors and errors[0] not in how else ""
    return f"{who}{where} {how}{after}{detail}"


def decide(exit_code: int, failures: list[TaskFailure], beats: dict[int, Beat], manifest: dict,
           logged_status: str | None = None) -> Ending:
    """The ending to record for a life whose srun (or local launcher) exited with ``exit_code``."""
    state = manifest.get("state")
    if exit_code == 0:
        return Ending(state="COMPLETED" if state in ("RUNNING", "STARTING") else None, exit_code=0)
    culprit = failures[0] if failures else None
    if culprit is not None and culprit.node_failure and not culprit.ranks:
        culprit.ranks = sorted(r for r, b in beats.items() if b.node == culprit.node and not b.exit)
    reason = describe(culprit, beats) if culprit else f"the ranks ended with exit code {exit_code}"
    nodes = [culprit.node] if culprit and culprit.node else []
    nodes = nodes or list(dict.fromkeys(beats[r].node for r in (culprit.ranks if culprit else []) if r in beats))
    if exit_code == HANG_EXIT_CODE or (culprit and culprit.code == HANG_EXIT_CODE):
        new_state = "HANG"
    elif (culprit and culprit.node_failure) or logged_status == "node_failure":
        new_state = "NODE_FAIL"
    elif logged_status == "out_of_memory":
        new_state = "OUT_OF_MEMORY"
    else:
        new_state = "FAILED"
    return Ending(state=None if state == "REQUEUED" else new_state, exit_code=exit_code, reason=reason,
                  failed_ranks=culprit.ranks if culprit else [], failed_nodes=nodes)


def record_end(run: RunFolder, exit_code: int, failures: list[TaskFailure] | None = None,
               restart: int | None = None) -> dict:
    """Record how this life of the run ended (see the module docstring); returns the manifest as recorded.

    ``failures``: the launcher's own knowledge (the local executor's exit codes); else srun's reports in the logs.
    Never raises for a full or read-only disk: the record is then lost, not the job's exit code.
    """
    manifest = run.manifest()
    restart = manifest.get("restart_count", 0) if restart is None else restart
    beats = heartbeat.read_all(run.path, restart)
    if failures is None:
        failures = read_srun_reports(run) if exit_code else []
    failures = failures or (from_heartbeats(beats, manifest.get("world_size")) if exit_code else [])
    logged = from_logs(log_files(run)) if exit_code else None
    ending = decide(exit_code, failures, beats, manifest, logged.status if logged else None)
    full = disk_full(run.path) if exit_code else None
    if full and ending.reason and "No space left" not in ending.reason:
        ending.reason += f"; {full}"
    fields: dict = {"exit_code": exit_code, "batch_ended": now_iso()}
    entry = {"restart": restart, "exit_code": exit_code, "ended": fields["batch_ended"]}
    if newer_life(manifest, restart):  # an earlier life's epilogue, late: its words go to the history, nothing else
        entry.update(state=ending.state, reason=ending.reason or None, failed_ranks=ending.failed_ranks,
                     failed_nodes=ending.failed_nodes, error=None)
        run.update(event="batch ended (an earlier life)", soft=True)
        return run.update(soft=True, lives=[*(run.manifest().get("lives") or []), entry])
    if ending.state:  # the registry keeps a terminal state the ranks recorded (PREEMPTED gives way to a failure)
        fields["state"] = ending.state
        if not is_terminal(manifest.get("state")):
            fields["ended"] = now_iso()
    earlier = earlier_outcome(manifest)
    # the latest life's outcome wins: an earlier life's culprit and error give way to this life's (a completed life
    # has none); a reason this life's own writers recorded (the watchdog's hang verdict) stays
    fields.update(dict.fromkeys(earlier))
    if ending.reason and (not manifest.get("reason") or "reason" in earlier):
        fields.update(reason=ending.reason, failed_ranks=ending.failed_ranks, failed_nodes=ending.failed_nodes)
    merged = run.update(event="batch ended", soft=True, **fields)
    entry.update(state=merged.get("state"), **{k: merged.get(k) for k in OUTCOME})
    return run.update(soft=True, lives=[*history(manifest, earlier), entry])  # no event: the events stay small


# The fields that tell how one life ended. Each life's values are kept in the manifest's ``lives`` (the history,
# one entry per life, oldest first); only the latest life's stay at the top, where ``status`` reads them.
OUTCOME = ("reason", "error", "failed_ranks", "failed_nodes")
# Events that begin a life or a step of it: the batch script's start (``job.open_run``), rank 0's start
# (``runtime.rank``, which clears the culprit fields but not ``error``) and an in-job restart (``job.restarts``).
LIFE_STARTS = ("batch started", "started", "restarting")


def newer_life(manifest: dict, restart: int) -> bool:
    """Whether a later life of the job has begun (its batch script recorded ``batch started`` with a higher restart
    count): this epilogue ends an earlier life that Slurm requeued while its batch script still ran."""
    starts = [e for e in manifest.get("events") or [] if e.get("event") == "batch started"]
    return bool(starts) and int(starts[-1].get("restart_count") or 0) > restart


def earlier_outcome(manifest: dict) -> dict[str, tuple[int | None, object]]:
    """The outcome fields (``OUTCOME``) the manifest holds from before the latest start (``LIFE_STARTS``): field ->
    (the restart count of the start it was recorded after, or None; its value). A value no event set (the manifest
    was created with it) is earlier when a start came since; with no start at all, everything is this life's."""
    events = manifest.get("events") or []
    starts = [i for i, e in enumerate(events) if e.get("event") in LIFE_STARTS]
    out: dict[str, tuple[int | None, object]] = {}
    for key in OUTCOME if starts else ():
        setters = [i for i, e in enumerate(events) if e.get(key)]
        at = setters[-1] if setters else -1
        if manifest.get(key) and at < starts[-1]:
            out[key] = (next((events[i].get("restart_count") for i in reversed(starts) if i < at), None),
                        manifest[key])
    return out


def history(manifest: dict, earlier: dict[str, tuple[int | None, object]]) -> list[dict]:
    """The manifest's ``lives``, plus an entry for the earlier outcome no epilogue recorded (a life whose batch
    script was killed with its node leaves rank 0's error, and the culprit only in the manifest)."""
    lives = [dict(x) for x in manifest.get("lives") or []]
    known = {repr(x.get(k)) for x in lives for k in OUTCOME}
    left = {k: value for k, (_, value) in earlier.items() if repr(value) not in known}
    if left:
        life = next((n for n, _ in earlier.values() if n is not None), None)
        lives.append({"restart": life, "state": None, "exit_code": None, "ended": None,
                      **{k: left.get(k) for k in OUTCOME}})
    return lives


def disk_full(path: Path, below_bytes: int = 4 << 20) -> str | None:
    """A note when the disk holding ``path`` has (almost) no space left: writers such as ``torch.save`` report a
    full disk as a bare "file write failed", without the errno."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    free = st.f_bavail * st.f_frsize
    return f"No space left on device: the run folder's disk has {free // 1024} KiB free" if free < below_bytes else None


def find_own_run(path: Path, env: dict[str, str]) -> RunFolder | None:
    """The run folder ``path``, or (a job array's runs root) the run under it whose job id is this job's."""
    run = RunFolder(path)
    if run.exists():
        return run
    from hpc_tools.registry import list_runs
    from hpc_tools.runtime.distenv import DistEnv

    job_id = DistEnv.from_environ({k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE")}).job_id
    return next((r for r in reversed(list_runs(Path(path))) if str(r.manifest().get("job_id")) == str(job_id)), None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_tools.job.epilogue", description=__doc__.split("\n")[0])
    parser.add_argument("--run-dir", required=True, type=Path, help="the run folder")
    parser.add_argument("--exit-code", required=True, type=int, help="srun's exit status ($?)")
    args = parser.parse_args(argv)
    try:
        run = find_own_run(args.run_dir, dict(os.environ))
        if run is None:
            print(f"hpc_tools epilogue: no run folder of this job under {args.run_dir}; nothing recorded",
                  file=sys.stderr)
            return 0
        manifest = record_end(run, args.exit_code, restart=restart_count(dict(os.environ)))
    except Exception as exc:  # the batch script's exit code must survive whatever happens here
        print(f"hpc_tools epilogue: could not record the end of the run: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return 0
    print(f"hpc_tools: run ended {manifest.get('state')} (exit code {args.exit_code})"
          + (f": {manifest['reason']}" if manifest.get("reason") else ""), file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
