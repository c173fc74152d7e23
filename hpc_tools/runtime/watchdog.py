"""Hang detection with a culprit: heartbeats, and when no step completes within the timeout, one verdict.

Each rank runs a daemon thread (a hung collective never returns) that rewrites the rank's heartbeat about once a
second (``hpc_tools.runtime.heartbeat``). When the phase it watches (the first step of a start, a step, a checkpoint
save, an evaluation) has made no progress for that phase's bound (``hpc_tools.runtime.hang_bounds``: calibrated from
the run's own observed maxima, or ``cluster.hang_timeout_min`` when set), the thread:

1. dumps this rank's stacks to ``hang/stack-rank<R>.txt`` (and, on GPU, PyTorch's NCCL flight recorder to
   ``hang/nccl_trace_rank<R>.json``), refreshes its heartbeat, and waits ``GATHER_S`` for its peers to do the same;
2. compares the heartbeats of every rank (``hang_verdict``): a rank whose heartbeat stopped (stopped or frozen
   process, dead node) or whose main thread is outside any collective is a culprit; the others waited in the
   collective their frames name;
3. the first rank to claim ``HANG.txt`` (an exclusive link) writes the verdict line, the heartbeats and every stack
   file into it and hands the verdict to ``on_hang`` (rank runtime: the manifest's state ``HANG`` and reason);
4. exits with ``HANG_EXIT_CODE`` so srun tears the step down. A rank that wakes after the verdict (SIGCONT during the
   teardown) finds ``HANG.txt`` and exits without a word.

Hang to teardown: the phase's bound + at most ``CHECK_S`` + ``GATHER_S`` + srun's termination; the verdict's
``detection`` (phase, bound, seconds from the last progress to the verdict) goes into HANG.txt and the manifest.

The step clock stops outside the steps (``outside_step``: a checkpoint save, its wait for a background write or a
replica; an evaluation): what happens there is bounded by its own progress instead (``progress``, told at each phase
and each chunk copied), so a long save never counts toward a step, and a save that makes no progress for its bound
is a hang. Every completed phase is an observation (``Bounds.add``); rank 0's thread keeps the maxima in the run
folder when they grow, so the next start is calibrated from its first step.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from hpc_tools.runstate import HANG_EXIT_CODE
from hpc_tools.runstate import HANG_MARKER as MARKER
from hpc_tools.runtime import hang_bounds, heartbeat
from hpc_tools.runtime.hang_bounds import FIRST, SAVE, STEP, Bounds
from hpc_tools.runtime.heartbeat import Beat, ranks_text

HANG_DIR = "hang"  # per-rank stacks and NCCL flight-recorder dumps
CHECK_S = heartbeat.INTERVAL_S
GATHER_S = 2.0  # time the peers get to dump their stacks and refresh their heartbeats before the verdict
STALE_S = 5.0  # a heartbeat older than this at verdict time: that rank stopped responding
# Extra time allowed before the first step of a start (imports, rendezvous, model build, checkpoint load), so that a
# short timeout meant for steps does not fire while a loaded node is still starting.
STARTUP_S = hang_bounds.STARTUP_S


@dataclass(frozen=True)
class HangVerdict:
    """Who stopped the job and who waited for it."""

    culprits: list[int]
    nodes: list[str]
    waiting: list[int]
    line: str
    steps: dict[int, int] = field(default_factory=dict)
    # how it was found: {"phase", "timeout_s", "bound" (why that bound), "detected_after_s" (last progress to the
    # verdict), "step", "restart"}; None from ``hang_verdict`` alone
    detection: dict | None = None


def hang_verdict(beats: dict[int, Beat], now: float, world_size: int, stale_s: float = STALE_S) -> HangVerdict:
    """Name the culprit(s) of a hang from every rank's heartbeat at ``now`` (epoch seconds).

    Culprits, in order of evidence: ranks that never wrote a heartbeat or whose heartbeat stopped (older than
    ``stale_s``), then live ranks whose main thread is outside every collective; when every rank waits in a
    collective (mismatched collectives), the ranks with the lowest step.
    """
    missing = [r for r in range(world_size) if r not in beats]
    stale = [r for r, b in beats.items() if now - b.time > stale_s]
    busy = [r for r, b in beats.items() if r not in stale and not b.collective]
    culprits = sorted(missing + stale + busy)
    if not culprits and beats:
        low = min(b.step for b in beats.values())
        culprits = sorted(r for r, b in beats.items() if b.step == low)
    waiting = sorted(r for r in beats if r not in culprits)
    parts = []
    for r in culprits:
        b = beats.get(r)
        if b is None:
            parts.append(f"rank {r} never reported (no heartbeat)")
            continue
        where = f" in {b.collective or b.frame}" if (b.collective or b.frame) else ""
        if r in stale:  # its last heartbeat: the step may be a second behind the truth
            parts.append(f"rank {r} ({b.node}) stopped responding{where}, last seen after step {b.step} "
                         f"(no heartbeat for {now - b.time:.0f} s)")
        else:
            parts.append(f"rank {r} ({b.node}) stopped{where} after step {b.step}")
    by_collective: dict[tuple[str, int], list[int]] = {}
    for r in waiting:
        by_collective.setdefault((beats[r].collective or beats[r].frame or "?", beats[r].step), []).append(r)
    parts += [f"{ranks_text(rs)} waited in {name} after step {step}" for (name, step), rs in by_collective.items()]
    nodes = list(dict.fromkeys(beats[r].node for r in culprits if r in beats))
    return HangVerdict(culprits=culprits, nodes=nodes, waiting=waiting, line="; ".join(parts),
                       steps={r: b.step for r, b in beats.items()})


class Watchdog:
    """This rank's heartbeat writer and hang detector: every phase bounded by ``timeout_s`` (<= 0: heartbeats only),
    or by ``bounds`` when given (``hang_bounds.Bounds``: calibrated per phase)."""

    def __init__(self, timeout_s: float, run_dir: Path, rank: int, world_size: int = 1, restart: int = 0,
                 on_hang: Callable[[HangVerdict], None] | None = None, bounds: Bounds | None = None):
        self.bounds = bounds if bounds is not None else Bounds.fixed(timeout_s)
        self.timeout_s = self.bounds.cap_s
        self.run_dir = Path(run_dir)
        self.world_size = world_size
        self.on_hang = on_hang
        self.beat_record = Beat(rank=rank, node=heartbeat.node_name(), pid=os.getpid(), restart=restart)
        self._last = self._born = time.monotonic()
        self._section: str | None = None  # what runs outside the step clock (``outside_step``), or None
        self._progress = self._last  # its last progress
        self._stall = 0.0  # the section's longest stretch without progress so far
        self._progressed = False  # the section reported progress (a save that saved something)
        self._dirty = False  # a maximum grew since rank 0 last kept them in the run folder
        self._started_step: int | None = None  # the first step this start completed (None: still starting)
        self._stop = threading.Event()
        # one heartbeat write at a time, and none after the exit record: a beat the watcher had serialized before
        # ``stop`` and renamed after it replaced the exit record, and the restart controller, finding no error, took
        # an out-of-memory error for a transient exit and restarted (seen once on the loaded test cluster)
        self._write_lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name="hpc_tools-watchdog", daemon=True)

    @property
    def rank(self) -> int:
        return self.beat_record.rank

    @property
    def started_step(self) -> int | None:
        """The first step this start completed (None: none yet)."""
        return self._started_step

    @property
    def marker(self) -> Path:
        return self.run_dir / MARKER

    def start(self) -> "Watchdog":
        heartbeat.write(self.run_dir, self.beat_record)
        self._thread.start()
        return self

    def beat(self, step: int) -> None:
        """A step completed (called by the loop after every step)."""
        now = time.monotonic()
        self.beat_record.step = step
        if self._started_step is None:
            self._dirty |= self.bounds.add(FIRST, now - self._born)
            self._started_step = step
        else:
            self._dirty |= self.bounds.add(STEP, now - self._last)
        self._last = now

    @contextlib.contextmanager
    def outside_step(self, what: str):
        """``what`` (e.g. a checkpoint save) runs outside the step clock: its time never counts toward a step's
        timeout; while it runs, a hang is its phase's bound (``what``: ``checkpoint save``, ``evaluation``) without
        ``progress``."""
        t0 = time.monotonic()
        self._progress, self._stall, self._progressed, self._section = t0, 0.0, False, what
        try:
            yield
        finally:
            end = time.monotonic()
            self._section = None
            self._last += end - t0  # the step clock resumes where it stopped
            stall = max(self._stall, end - self._progress)
            # a save section that reported no progress saved nothing (the saver is called after every step): not an
            # observation of a save; an evaluation reports none and always is one
            if self._progressed or what != SAVE:
                self._dirty |= self.bounds.add(what, stall)

    def progress(self) -> None:
        """What runs outside the step clock moved on (a phase ended, bytes were copied)."""
        now = time.monotonic()
        self._stall = max(self._stall, now - self._progress)
        self._progress, self._progressed = now, True

    def stop(self, exit_code: int | None = None, error: str | None = None, **detail) -> None:
        """Stop watching; with ``exit_code``, record how this rank exits in its heartbeat (``detail``: what the
        restart controller classifies an exception by, ``hpc_tools.runtime.rank.exception_record``)."""
        self._stop.set()
        if exit_code is not None:
            with self._write_lock:  # after a write in flight, and the last one (_refresh)
                self.beat_record.exit = {"code": exit_code, "error": error, "time": time.time(), **detail}
                self.beat_record.frame, self.beat_record.collective = "", None
                heartbeat.write(self.run_dir, self.beat_record)

    def _refresh(self) -> None:
        with self._write_lock:
            if self.beat_record.exit is not None:  # the exit record is this rank's last word
                return
            self.beat_record.frame, self.beat_record.collective = heartbeat.main_thread_frames()
            heartbeat.write(self.run_dir, self.beat_record)

    def phase(self) -> tuple[str, float]:
        """(the phase watched now, the seconds it has gone without progress)."""
        section = self._section
        if section is not None:
            return section, time.monotonic() - self._progress
        return (FIRST if self._started_step is None else STEP), time.monotonic() - self._last

    def _watch(self) -> None:
        while not self._stop.wait(CHECK_S):
            self._refresh()
            if self._dirty and self.rank == 0:
                self._dirty = False
                self.bounds.save(self.run_dir)
            phase, idle = self.phase()
            if not self.bounds.off and idle > self.bounds.bound(phase):
                self._hang(idle, self._section)

    def _hang(self, idle: float, section: str | None = None) -> None:
        if self.marker.exists():  # a peer named the culprit already (this rank may be it, woken by the teardown)
            os._exit(HANG_EXIT_CODE)
        folder = self.run_dir / HANG_DIR
        stack = folder / f"stack-rank{self.rank:05d}.txt"
        with contextlib.suppress(OSError):
            folder.mkdir(parents=True, exist_ok=True)
            with open(stack, "w") as f:
                f.write(f"rank {self.rank} ({self.beat_record.node}): {_stalled(idle, section)} "
                        f"({self._timeout_words()}); last step {self.beat_record.step}\n")
                faulthandler.dump_traceback(file=f, all_threads=True)
        dump_flight_recorder(folder, self.rank)
        self._refresh()
        time.sleep(GATHER_S)
        verdict = hang_verdict(heartbeat.read_all(self.run_dir, self.beat_record.restart), time.time(),
                               self.world_size)
        verdict = replace(verdict, detection=self._detection(section))
        if self._claim(verdict, idle, section):
            print(f"hpc_tools: HANG: {verdict.line}", file=sys.stderr, flush=True)
            if self.on_hang is not None:
                with contextlib.suppress(Exception):
                    self.on_hang(verdict)
        faulthandler.dump_traceback(all_threads=True)
        os._exit(HANG_EXIT_CODE)

    def _claim(self, verdict: HangVerdict, idle: float, section: str | None = None) -> bool:
        """Write ``HANG.txt`` unless a peer did first (link is exclusive); True for the rank that wrote it."""
        folder = self.run_dir / HANG_DIR
        lines = [verdict.line, "",
                 f"{_stalled(idle, section)} ({self._timeout_words()}); verdict by rank {self.rank}",
                 "", "== heartbeats =="]
        for r, b in sorted(heartbeat.read_all(self.run_dir, self.beat_record.restart).items()):
            lines.append(f"rank {r} ({b.node}, pid {b.pid}): step {b.step}, {time.time() - b.time:.1f} s ago, "
                         f"{'waiting in ' + b.collective if b.collective else 'in ' + b.frame}")
        for path in sorted(folder.glob("stack-rank*.txt")) if folder.is_dir() else []:
            with contextlib.suppress(OSError):
                lines += ["", f"== {path.name} ==", path.read_text(errors="replace").rstrip()]
        tmp = self.run_dir / f".{MARKER}.rank{self.rank}"
        try:
            tmp.write_text("\n".join(lines) + "\n")
            os.link(tmp, self.marker)
            return True
        except OSError:
            return False
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()


    def _timeout_words(self) -> str:
        phase, _ = self.phase()
        return f"the {phase} bound: {self.bounds.why(phase)}"

    def _detection(self, section: str | None) -> dict:
        """How this hang was found: the phase, its bound and why, the seconds from its last progress to now."""
        phase, idle = self.phase()
        return {"phase": section or phase, "timeout_s": round(self.bounds.bound(phase), 3),
                "bound": self.bounds.why(phase), "detected_after_s": round(idle, 3), "step": self.beat_record.step,
                "restart": self.beat_record.restart}


def _stalled(idle: float, section: str | None) -> str:
    return f"no progress in the {section} for {idle:.0f} s" if section else f"no step completed for {idle:.0f} s"


def dump_flight_recorder(folder: Path, rank: int) -> None:
    """On GPU, PyTorch's NCCL flight recorder (the last collectives of every process group) as JSON, if enabled."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE"):
        return
    with contextlib.suppress(Exception):
        data = torch._C._distributed_c10d._dump_fr_trace_json()
        (folder / f"nccl_trace_rank{rank:05d}.json").write_bytes(data)
