"""The next step's batch built while this step trains (GPU ranks), in page-locked memory.

The loop asks an engine for step s's batch after step s-1's end-of-step sync, while the GPU idles (~16 ms per
gpt_3d step, ~2.5 %). A batch is a pure function of the step (``hpc_tools.train.data``), so it can be built ahead:
``BatchPrefetcher.get(s)`` returns step s's batch (built ahead when the previous call asked for s-1) and starts
building s+1 on one background thread. On a GPU the tensors are pinned there too, so the engine's host-to-device
copy is asynchronous. On CPU nothing runs ahead (``background=False``): the batches are built as before, in the
caller's thread, and are the same tensors either way.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

Batch = list[dict[str, Any]]


def pinned(tensor):
    """``tensor`` in page-locked memory: itself when already pinned. A view that repeats memory (an ``expand``,
    stride 0) is made contiguous first: CUDA's pin_memory refuses one ("more than one element of the written-to
    tensor refers to a single memory location"); for any other tensor ``contiguous()`` is the tensor itself."""
    return tensor if tensor.is_pinned() else tensor.contiguous().pin_memory()


def to_device(tensor, device):
    """``tensor`` on ``device``: on an accelerator copied from page-locked memory without blocking the host (from
    pageable memory a copy waits for a staging copy on the host; the prefetcher pins batches ahead); on CPU the
    tensor itself. The one host-to-device batch copy of every backend."""
    if device.type == "cpu":
        return tensor
    return pinned(tensor).to(device, non_blocking=True)


def pin_batch(batch: Batch) -> Batch:
    """Every tensor of every microbatch in page-locked memory (other values as they are)."""
    return [{k: pinned(v) if hasattr(v, "pin_memory") else v for k, v in mb.items()} for mb in batch]


class BatchPrefetcher:
    """``get(step)`` = ``build(step)`` (pinned when ``pin``), with ``build(step + 1)`` started in the background
    after each call (when ``background`` and ``step < last_step``). A failure while building ahead is raised by the
    ``get`` of that step, as if it had been built then. ``close()`` drops what is pending."""

    def __init__(self, build: Callable[[int], Batch], last_step: int, *, background: bool, pin: bool):
        self._build, self._last, self._pin = build, last_step, pin
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batch-prefetch") if background else None
        self._ahead: tuple[int, Future] | None = None

    def _make(self, step: int) -> Batch:
        batch = self._build(step)
        return pin_batch(batch) if self._pin else batch

    def get(self, step: int) -> Batch:
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == step:
            batch = ahead[1].result()
        else:
            if ahead is not None:
                ahead[1].cancel()
            batch = self._make(step)
        if self._pool is not None and step < self._last:
            self._ahead = (step + 1, self._pool.submit(self._make, step + 1))
        return batch

    @property
    def ahead(self) -> int | None:
        """The step being built ahead, if any."""
        return self._ahead[0] if self._ahead else None

    def close(self) -> None:
        self._ahead = None
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
