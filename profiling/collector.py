"""The collector both trainers call around every step; configured by the recipe's ``profiling:`` section.

Usage on every rank::

    collector = StepCollector.for_rank(ctx, tp_rank=..., pp_rank=..., dp_rank=...)
    for step in range(start, end + 1):
        collector.start_step(step)
        with collector.data_timer():        # or collector.add_data_time(seconds)
            batch = next(data)
        ...                                 # forward/backward/optimizer
        collector.end_step(step, loss=..., lr=..., grad_norm=...)
    collector.close()

What it measures (each optional part switched by ``profiling.*``):

* step time: CUDA events on GPU, ``perf_counter`` on CPU. The one host-GPU synchronisation is in ``end_step``: it
  waits for the step-end event (the work queued so far); a trainer that already called ``loss.item()`` pays nothing.
* tokens/s (job and per GPU), model TFLOP/s per GPU, MFU and HFU (recomputation counted) under
  ``profiling.flops_convention``; MFU is null when the peak is unknown (``profiling.peaks``).
* memory: ``max_memory_allocated``/``reserved`` over the step (peak reset at ``start_step``), RSS.
* communication (``comm.py``): on every ``communication_sample_interval``-th step, time and bytes per collective kind
  into the step record and ``records/comm_rank<R>.jsonl`` (with bus bandwidth).
* pipeline bubble: with pipeline_size > 1, time stalled in pipeline p2p on every step (``pp_wait_s``), over the step
  time (``bubble_fraction``), next to the theory ``(p-1)/(v m)`` in the summaries.
* host time (every step, two ``getrusage`` calls): CPU time of the rank process over the step (``cpu_time_s``,
  every thread: torch's intra-op threads count) and its involuntary context switches (``involuntary_switches``);
  with the communication tracer, the host time held in collectives every step (``collective_wait_s``, CPU ranks);
  and the time the host kept the process from running at all (``host_stall_s``: stopped or descheduled, ``stall.py``).
  What they tell (a rank the host stalled from one slow in its own code): ``stragglers.py``.
* GPU telemetry (``telemetry.py``), a torch.profiler window (``trace.py``), summaries (``summary.py``, whose figures
  ``figures.py`` defines for the summary, ``analyze`` and the calibration alike).
* events outside the steps (``event``): this start of the rank (process start, node) when the collector opens, and
  the checkpoint saves and loads the loop times, one JSON line each in ``records/events_rank<R>.jsonl`` (read by
  ``goodput.py``).

Fault injection for tests only: ``HPC_TOOLS_TEST_SLOW_RANK=RANK:KIND:SECONDS[,...]`` (KIND ``compute``, ``data`` or
``save``) makes that rank spend SECONDS more on every step: sleeping inside the data timer (``data``: waiting on
input), or right after it, before the step's work, busy on its CPU (``compute``: spinning, as slower compute would): a
real straggler whose peers wait for it in the step's collectives; ``save``: on every checkpoint save instead, before
the write (a slow checkpoint folder; ``injected_save_s``, read by the checkpoint saver).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import resource
import socket
import time
from pathlib import Path
from typing import Any

from profiling import comm as comm_mod
from profiling.clock import Clock
from profiling.records import RecordWriter, comm_path, events_path
from profiling.schema import FIELD_NAMES, SCHEMA_VERSION
from profiling.stall import StallClock
from profiling.summary import RankSummary, format_comm_line, format_job_line, merge, write_rank
from profiling.trace import COMPUTE, DATA, span

SUMMARY_MERGE_WAIT_S = 10.0
DETAIL_LOGGER = "hpc_tools.detail"
"""Logger of lines meant for a rank's log file, not the console (``hpc_tools.runtime.ranklog`` routes it)."""
SLOW_RANK_ENV = "HPC_TOOLS_TEST_SLOW_RANK"


def injected_delays(rank: int, spec: str | None = None) -> dict[str, float]:
    """{"compute"|"data"|"save": seconds} this rank spends per step (``save``: per checkpoint save), from
    ``HPC_TOOLS_TEST_SLOW_RANK`` (tests only): ``RANK:compute|data|save:SECONDS`` items, ``*`` for every rank
    (``*:data:0.05`` paces an endless job that a test only waits on: its ranks sleep in each step's data loading
    instead of taking the cores)."""
    spec = os.environ.get(SLOW_RANK_ENV, "") if spec is None else spec
    out: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        try:
            r, kind, seconds = item.split(":")
            if kind not in ("compute", "data", "save"):
                raise ValueError(kind)
            if r == "*" or int(r) == rank:
                out[kind] = out.get(kind, 0.0) + float(seconds)
        except ValueError:
            raise ValueError(f"{SLOW_RANK_ENV}={spec!r}: each item must be RANK|*:compute|data|save:SECONDS") from None
    return out


def burn_cpu(seconds: float) -> None:
    """Keep this thread busy on its CPU for ``seconds`` (test-only slow compute): it takes all the CPU the host gives
    it, so its peers wait ``seconds`` for it and its CPU time shows the extra work."""
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        for i in range(1000):
            x += i


def process_start_time() -> float | None:
    """Unix time this process started (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


class _Rss:
    """Resident set size: /proc/self/statm read with one pread (~5 us), psutil elsewhere."""

    def __init__(self):
        import os

        self._os, self._fd, self._proc = os, None, None
        try:
            self._fd = os.open("/proc/self/statm", os.O_RDONLY)
            self._page = os.sysconf("SC_PAGE_SIZE")
        except OSError:
            try:
                import psutil

                self._proc = psutil.Process()
            except Exception:  # psutil missing: RSS is optional
                pass

    def __call__(self) -> int | None:
        if self._fd is not None:
            return int(self._os.pread(self._fd, 128, 0).split()[1]) * self._page
        return self._proc.memory_info().rss if self._proc is not None else None

    def close(self) -> None:
        if self._fd is not None:
            self._os.close(self._fd)
            self._fd = None


def _rank0_detail(ctx):
    """Where the collector's ``comm`` line (bus bandwidth of sampled collectives) goes: rank 0's log file only (the
    ``DETAIL_LOGGER``, routed by ``hpc_tools.runtime.ranklog``), the console keeping the loop's progress line."""
    return logging.getLogger(DETAIL_LOGGER).info if ctx.is_rank0 else None


class StepCollector:
    def __init__(self, *, run_id: str, records_dir, rank: int, world_size: int, job_id: str | None, restart: int,
                 tokens_per_step: int, coords: dict[str, int], enabled: bool = True, summary_interval: int = 10,
                 log=None, config=None, cuda: bool = False, model_flops: float | None = None,
                 hardware_flops: float | None = None, peak_tflops: float | None = None,
                 flops_convention: str = "megatron", pipeline_size: int = 1, theory_bubble: float | None = None,
                 run_dir=None, device_index: int = 0, header: dict[str, Any] | None = None):
        from hpc_tools.recipe.profiling import ProfilingConfig

        self.cfg = config if config is not None else ProfilingConfig(enabled=enabled, summary_interval=summary_interval)
        self.run_id, self.rank, self.world_size = run_id, rank, world_size
        self.job_id, self.restart = job_id, restart
        self.tokens_per_step = tokens_per_step
        self.coords = coords
        self.enabled = enabled and self.cfg.enabled
        self.summary_interval = self.cfg.summary_interval
        self.log = log
        self.node = socket.gethostname()
        self.records_dir = Path(records_dir)
        self.run_dir = Path(run_dir) if run_dir is not None else self.records_dir.parent
        self.cuda = cuda
        self.clock = Clock(cuda)
        self.model_flops, self.hardware_flops, self.peak_tflops = model_flops, hardware_flops, peak_tflops
        self.convention = flops_convention
        self.theory_bubble = theory_bubble
        self._rss = _Rss() if self.cfg.memory else None
        self._t0 = None
        self._ru0 = None
        self._data_s = 0.0
        self._comm_file = None
        self._measure_bubble = False
        self._delays = injected_delays(rank)
        self._events_file = None
        self._pending: dict[str, Any] | None = None
        self.writer = self.tracer = self.telemetry = self.trace = None
        self._stall = None
        self._stall0 = 0.0
        self.summary = RankSummary(self.cfg.warmup_steps, {
            "run_id": run_id, "rank": rank, **coords, "world_size": world_size, "job_id": job_id, "restart": restart,
            "flops_convention": flops_convention, "peak_tflops_per_gpu": peak_tflops,
            "model_flops_per_step": model_flops, "hardware_flops_per_step": hardware_flops,
            "tokens_per_step": tokens_per_step, "bubble_theory": theory_bubble,
            "timing": "cuda-events" if cuda else "perf_counter", **(header or {})})
        if self.enabled:
            self._start(pipeline_size, device_index)

    def _start(self, pipeline_size: int, device_index: int) -> None:
        """An enabled collector's parts: the record writer and its start event, the stall clock, the collective
        tracer (communication, or the pipeline bubble's p2p waits), GPU telemetry and the torch-profiler traces."""
        rank, cuda = self.rank, self.cuda
        self.writer = RecordWriter(self.records_dir, rank)
        self.event("start", process_start=process_start_time(), node=self.node)
        self._stall = StallClock()
        measure_bubble = self._measure_bubble = self.cfg.pipeline_bubble and pipeline_size > 1
        if self.cfg.communication or measure_bubble:
            self.tracer = comm_mod.CommTracer(self.clock, p2p_every_step=measure_bubble,
                                              host_wait=self.cfg.communication)
            comm_mod.install(self.tracer)
        if self.cfg.gpu_telemetry and cuda:
            from profiling.telemetry import TelemetrySampler

            self.telemetry = TelemetrySampler(self.records_dir, rank, device_index,
                                              self.cfg.telemetry_interval_s).start()
        tp = self.cfg.torch_profiler
        window = (tp.start_step, tp.num_steps) if tp.enabled and rank in tp.ranks else None
        if window or self.cfg.trace_sample_interval:
            from profiling.trace import Traces

            self.trace = Traces(self.run_dir / "profiler", rank, cuda, window, self.cfg.trace_sample_interval,
                                self.cfg.warmup_steps)

    @classmethod
    def for_rank(cls, ctx, *, tp_rank: int = 0, pp_rank: int = 0, dp_rank: int | None = None) -> "StepCollector":
        """The collector for this rank, configured from ``ctx.recipe.profiling`` (FLOPs, peak, hooks)."""
        from hpc_tools import backends
        from profiling.flops import hardware_flops_per_step, model_flops_per_step
        from profiling.peaks import peak_for_recipe
        from profiling.trace_ranks import traced_ranks

        r, layout = ctx.recipe, ctx.layout
        cuda = ctx.device_type == "cuda"
        device_name, device_index = None, 0
        if cuda:
            import torch

            device_index = torch.cuda.current_device()
            device_name = torch.cuda.get_device_name(device_index)
        model_flops = hardware_flops = peak = None
        row = backends.of(r)
        if row.trains_model:
            conv = r.profiling.flops_convention
            # A padded vocabulary (Megatron pads it for TP) is computed, so its logits count.
            vocab = r.model.padded_vocab_size(layout.tensor_size) if row.pads_vocab else r.model.vocab_size
            model_flops = model_flops_per_step(r.model, layout.global_batch_size, convention=conv, vocab_size=vocab)
            hardware_flops = hardware_flops_per_step(r.model, layout.global_batch_size,
                                                     r.training.recompute_granularity, convention=conv,
                                                     vocab_size=vocab)
            # A recipe's gpu_type says nothing about CPU ranks: a peak only for real GPUs or an explicit override.
            if cuda or r.cluster.gpu_peak_tflops is not None:
                peak = peak_for_recipe(r, device_name)
        cfg = r.profiling
        if cfg.trace_sample_interval and ctx.rank not in traced_ranks(layout, cfg.trace_ranks):
            cfg = cfg.model_copy(update={"trace_sample_interval": 0})  # a rank outside profiling.trace_ranks
        return cls(run_id=ctx.run.run_id, records_dir=ctx.run.records_dir, rank=ctx.rank,
                   world_size=ctx.dist.world_size, job_id=ctx.dist.job_id, restart=ctx.dist.restart_count,
                   tokens_per_step=layout.global_batch_size * r.model.seq_length,
                   coords={"tp_rank": tp_rank, "pp_rank": pp_rank, "dp_rank": ctx.rank if dp_rank is None else dp_rank},
                   enabled=r.profiling.enabled, log=_rank0_detail(ctx), config=cfg, cuda=cuda,
                   model_flops=model_flops, hardware_flops=hardware_flops, peak_tflops=peak,
                   flops_convention=r.profiling.flops_convention, pipeline_size=layout.pipeline_size,
                   theory_bubble=layout.bubble_fraction if layout.pipeline_size > 1 else None,
                   run_dir=ctx.run.path, device_index=device_index,
                   header={"layout": layout.describe(), "gpu": device_name or ("cpu" if not cuda else None),
                           "recompute": r.training.recompute_granularity, "backend": r.backend.kind})

    # -- per step ------------------------------------------------------------------------------------------------------
    def start_step(self, step: int) -> None:
        self._commit()
        self._data_s = 0.0
        if self.trace is not None:
            self.trace.start_step(step)
        if self.cuda and self.cfg.memory and self.enabled:
            import torch

            torch.cuda.reset_peak_memory_stats()
        if self.tracer is not None:
            self.tracer.begin_step(self.cfg.communication and step % self.cfg.communication_sample_interval == 0)
        if self.telemetry is not None:
            self.telemetry.step = step
        self._ru0 = resource.getrusage(resource.RUSAGE_SELF) if self.enabled else None
        self._stall0 = self._stall.stalled_s if self._stall is not None else 0.0
        self._t0 = self.clock.mark()

    def add_data_time(self, seconds: float) -> None:
        self._data_s += seconds

    @contextlib.contextmanager
    def data_timer(self):
        """Time the enclosed batch loading as data time (host clock: loading is host work)."""
        t0 = time.perf_counter()
        try:
            with span(DATA):  # marked in a recording trace window: the breakdown's data bucket
                yield
                if self._delays:  # test-only fault injection (module docstring)
                    time.sleep(self._delays.get("data", 0.0))
        finally:
            self._data_s += time.perf_counter() - t0
        if self._delays.get("compute"):
            with span(COMPUTE):  # injected slow compute is compute to the breakdown, as real slow kernels are
                burn_cpu(self._delays["compute"])

    def end_step(self, step: int, *, loss: float | None = None, lr: float | None = None,
                 grad_norm: float | None = None, skipped: bool | None = None,
                 nonfinite: bool | None = None, figures: dict[str, Any] | None = None) -> dict[str, Any]:
        """The step's record; ``figures``: further schema fields the trainer measured (e.g. the MoE router's)."""
        end = self.clock.mark()
        ru0, ru1 = self._ru0, resource.getrusage(resource.RUSAGE_SELF) if self._ru0 is not None else None
        self.clock.wait(end)  # the collectors' one host-GPU synchronisation (see the module docstring)
        dt = self.clock.seconds(self._t0, end) if self._t0 is not None else 0.0
        tps = self.tokens_per_step / dt if dt > 0 else 0.0
        record = {
            "schema_version": SCHEMA_VERSION, "run_id": self.run_id, "job_id": self.job_id, "restart": self.restart,
            "rank": self.rank, "node": self.node, **self.coords, "step": step, "time": time.time(),
            "step_time_s": dt, "data_time_s": self._data_s, "tokens": self.tokens_per_step, "tokens_per_s": tps,
            "tokens_per_s_per_gpu": tps / self.world_size,
            "loss": None if loss is None else float(loss), "lr": None if lr is None else float(lr),
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "rss_bytes": self._rss() if self._rss is not None else None, "skipped": skipped,
            "nonfinite": nonfinite, "val_loss": None, "eval_time_s": None,  # keys on every line: readers of JSON
        }                                                                 # lines look for a column in the first
        if figures:
            unknown = set(figures) - set(FIELD_NAMES)
            if unknown:
                raise ValueError(f"step figures {sorted(unknown)} are not step record fields (profiling.schema)")
            record.update(figures)
        if not self.enabled:
            return record
        record.update(self._flops_fields(dt))
        if ru1 is not None:
            record["cpu_time_s"] = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
            record["involuntary_switches"] = ru1.ru_nivcsw - ru0.ru_nivcsw
        if self._stall is not None:
            record["host_stall_s"] = self._stall.stalled_s - self._stall0
        if self.cuda and self.cfg.memory:
            import torch

            record["mem_allocated_max_bytes"] = torch.cuda.max_memory_allocated()
            record["mem_reserved_max_bytes"] = torch.cuda.max_memory_reserved()
        comm_rows = self._comm_fields(step, dt, record) if self.tracer is not None else None
        self._pending = record  # written at the next step, event or close: an evaluation may still add to it
        self.summary.add(record, comm_rows)
        if self.trace is not None:
            self.trace.end_step(step)
        if self.log and step % self.summary_interval == 0:  # the step figures are the progress line's, not here
            line = format_comm_line(step, comm_rows)
            if line:
                self.log("%s", line)
        return record

    def add_evaluation(self, step: int, val_loss: float | None, seconds: float) -> None:
        """The evaluation after step ``step`` (its record is still pending): ``val_loss`` and ``eval_time_s`` join
        that record, outside its step time."""
        if self._pending is not None and self._pending.get("step") == step:
            self._pending["val_loss"] = None if val_loss is None else float(val_loss)
            self._pending["eval_time_s"] = float(seconds)

    def _commit(self) -> None:
        if self._pending is not None and self.writer is not None:
            self.writer.write(self._pending)
        self._pending = None

    def injected_save_s(self) -> float:
        """Seconds each checkpoint save of this rank is made slower by (test-only fault injection, module docstring)."""
        return self._delays.get("save", 0.0)

    def flush(self) -> None:
        """Put every record so far on disk now (before a checkpoint save, whose steps must be on disk with it)."""
        self._commit()
        if self.writer is not None:
            self.writer.flush()

    def _flops_fields(self, dt: float) -> dict[str, Any]:
        from profiling.peaks import hfu, mfu

        if self.model_flops is None or dt <= 0:
            return {}
        return {"model_flops": self.model_flops, "hardware_flops": self.hardware_flops,
                "tflops_per_gpu": self.model_flops / dt / self.world_size / 1e12,
                "mfu": mfu(self.model_flops, dt, self.world_size, self.peak_tflops),
                "hfu": hfu(self.hardware_flops, dt, self.world_size, self.peak_tflops)}

    def _comm_fields(self, step: int, dt: float, record: dict[str, Any]) -> list[dict[str, Any]] | None:
        sampled = self.tracer.sampling
        ops = self.tracer.end_step()
        record["collective_wait_s"] = self.tracer.collective_wait_s(ops)
        if self._measure_bubble:
            p2p = [op for op in ops if op.kind == "p2p"]
            record["pp_wait_s"] = sum(comm_mod.stalled_s(op, self.clock) for op in p2p)
            record["bubble_fraction"] = record["pp_wait_s"] / dt if dt > 0 else None
        if not sampled:
            return None
        rows = comm_mod.per_kind(ops, self.clock)
        record["comm_time_s"] = sum(r["time_s"] for r in rows)
        record["comm_bytes"] = sum(r["bytes"] for r in rows)
        if self._comm_file is None:
            self._comm_file = open(comm_path(self.records_dir, self.rank), "a", buffering=1)
        for row in rows:
            self._comm_file.write(json.dumps({"step": step, "rank": self.rank, "restart": self.restart, **row},
                                             separators=(",", ":")) + "\n")
        return rows

    # -- events outside the steps --------------------------------------------------------------------------------------
    def event(self, kind: str, seconds: float | None = None, step: int | None = None, **fields: Any) -> None:
        """Append one event (``start``, ``checkpoint_save``, ``checkpoint_load``) that ended now and took ``seconds``
        to this rank's events file, tagged with this start (``restart``)."""
        if not self.enabled:
            return
        self.flush()  # the steps before a checkpoint save or load are on disk before its event
        if self._events_file is None:
            self.records_dir.mkdir(parents=True, exist_ok=True)
            self._events_file = open(events_path(self.records_dir, self.rank), "a", buffering=1)
        row = {"event": kind, "time": time.time(), "seconds": seconds, "step": step, "rank": self.rank,
               "restart": self.restart, **fields}
        self._events_file.write(json.dumps(row, separators=(",", ":")) + "\n")

    # -- end -----------------------------------------------------------------------------------------------------------
    def summary_dict(self) -> dict[str, Any]:
        return self.summary.to_dict()

    def close(self) -> None:
        """Stop the hooks and threads, compact this rank's records, write its summary; rank 0 merges the job summary."""
        if not self.enabled or self.writer is None:
            return
        if self.tracer is not None:
            comm_mod.uninstall(self.tracer)
        if self.telemetry is not None:
            self.telemetry.stop()
        if self.trace is not None:
            self.trace.close()
        if self._comm_file is not None:
            self._comm_file.close()
        if self._events_file is not None:
            self._events_file.close()
            self._events_file = None
        if self._rss is not None:
            self._rss.close()
        if self._stall is not None:
            self._stall.close()
        self._commit()
        self.writer.close()
        self.writer = None
        write_rank(self.records_dir, self.rank, self.summary.to_dict())
        if self.rank == 0:
            job = merge(self.run_dir, self.world_size, wait_s=SUMMARY_MERGE_WAIT_S if self.world_size > 1 else 0.0,
                        restart=self.restart)
            if self.log and job:  # the job's one summary line: on the console too, unlike the comm lines
                logging.getLogger("hpc_tools").info("summary: %s", format_job_line(job))
