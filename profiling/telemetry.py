"""GPU telemetry: a daemon thread samples NVML (SM utilisation, memory, power, clocks, temperature) for this rank's GPU
into ``records/telemetry_rank<R>.jsonl``, each sample stamped with unix time and the step in progress (join to the
step records on ``rank`` and ``step``). Without a GPU or without NVML it does nothing, once, silently (debug log).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("hpc_tools.profiling")


def telemetry_path(records_dir: Path, rank: int) -> Path:
    return Path(records_dir) / f"telemetry_rank{rank:05d}.jsonl"


def _nvml_handle(device_index: int):
    """NVML handle of the CUDA device (matched by UUID, so CUDA_VISIBLE_DEVICES remapping is right)."""
    import pynvml
    import torch

    pynvml.nvmlInit()
    try:
        uuid = str(torch.cuda.get_device_properties(device_index).uuid)
        return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    except Exception:  # older drivers / MIG: fall back to the index
        return pynvml.nvmlDeviceGetHandleByIndex(device_index)


def sample(handle) -> dict[str, Any]:
    """One NVML reading; fields the GPU does not report are None."""
    import pynvml

    def read(fn, *args):
        try:
            return fn(handle, *args)
        except pynvml.NVMLError:
            return None

    util = read(pynvml.nvmlDeviceGetUtilizationRates)
    mem = read(pynvml.nvmlDeviceGetMemoryInfo)
    power_mw = read(pynvml.nvmlDeviceGetPowerUsage)
    return {
        "sm_util_pct": util.gpu if util else None,
        "mem_util_pct": util.memory if util else None,
        "mem_used_bytes": mem.used if mem else None,
        "power_w": power_mw / 1e3 if power_mw is not None else None,
        "sm_clock_mhz": read(pynvml.nvmlDeviceGetClockInfo, pynvml.NVML_CLOCK_SM),
        "mem_clock_mhz": read(pynvml.nvmlDeviceGetClockInfo, pynvml.NVML_CLOCK_MEM),
        "temperature_c": read(pynvml.nvmlDeviceGetTemperature, pynvml.NVML_TEMPERATURE_GPU),
    }


class TelemetrySampler:
    """``start()`` the thread, set ``step`` as steps begin, ``stop()`` at the end (joins and closes the file)."""

    def __init__(self, records_dir: Path, rank: int, device_index: int, interval_s: float = 1.0):
        self.path = telemetry_path(records_dir, rank)
        self.rank, self.device_index, self.interval_s = rank, device_index, interval_s
        self.step = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "TelemetrySampler | None":
        """Start sampling; None (and nothing started) when there is no GPU or NVML."""
        try:
            handle = _nvml_handle(self.device_index)
            sample(handle)
        except Exception as exc:  # no GPU, no pynvml, no driver: telemetry is optional
            log.debug("GPU telemetry off: %s", exc)
            return None
        self._thread = threading.Thread(target=self._run, args=(handle,), name="hpc-telemetry", daemon=True)
        self._thread.start()
        return self

    def _run(self, handle) -> None:
        with open(self.path, "a", buffering=1) as f:
            while not self._stop.is_set():
                row = {"time": time.time(), "rank": self.rank, "step": self.step, **sample(handle)}
                f.write(json.dumps(row, separators=(",", ":")) + "\n")
                self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
