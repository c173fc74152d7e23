"""Checkpoints with megatron.core.dist_checkpointing (torch_dist), in the folders of hpc_tools.checkpoints.dirs.

What a checkpoint holds: the model (ShardedTensors with layout-independent keys, so any TP/PP/VPP can load it), the
optimizer (the distributed optimizer in Megatron's `dp_reshardable` format, see below), every rank's RNG states, and
in the meta file the step, the number of optimizer steps taken, the layout it was saved under and every rank's list
of the files it saved with sizes and checksums (``hpc_tools.train.checkpointing``: the saver commits every save, the
resume verifies them before ``load``). The data position is the step.

Loading under another layout always restores the model; the optimizer state comes along when it can be resharded
(``hpc_tools.checkpoints.reshard``: the plain optimizer across any change that keeps expert parallelism on or off,
the distributed optimizer across a change of the data-parallel size only). Otherwise the load is refused in one line
before anything is read (``validate`` and ``submit`` refuse such a ``checkpoint.load_path`` first; the elastic planner
never picks such a layout).
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_tools.checkpoints.dirs import CheckpointDirs
from hpc_tools.checkpoints.reshard import DEFAULT_SIZES, layout_sizes, why_not
from hpc_tools.checkpoints.reshard import MEGATRON_FORMAT as FORMAT
from hpc_tools.checkpoints.reshard import size as _size
from hpc_tools.train import rng

if TYPE_CHECKING:
    from hpc_tools.train.megatron.engine import MegatronCore

log = logging.getLogger("hpc_tools.megatron")

# The distributed optimizer needs its sharding type named: "fully_reshardable" saves but then fails to load
# (KeyError: 'step'; docs/megatron-on-cpu.md), "dp_reshardable" reloads across a change of data-parallel size.
SHARDING = {"distrib_optim_sharding_type": "dp_reshardable"}


def layout_meta(engine: "MegatronCore") -> dict[str, Any]:
    lay, mg = engine.layout, engine.recipe.backend.megatron
    return {**layout_sizes(lay, mg.distributed_optimizer, engine.recipe.training.precision),
            "padded_vocab_size": engine.recipe.model.padded_vocab_size(lay.tensor_size), "layers": engine.plan.layers}




def inner_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


# -- state dicts -------------------------------------------------------------------------------------------------------

def model_state(engine: "MegatronCore") -> dict[str, Any]:
    from hpc_tools.train.megatron.model import unwrap

    return {f"model{i}": unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(engine.chunks)}


def rng_state(engine: "MegatronCore"):
    """This rank's RNG states (``hpc_tools.train.rng`` plus Megatron's tracker: tensor-parallel and expert streams)
    as a ShardedObject addressed by its (pp, tp, dp[, cp]) coordinates."""
    from megatron.core import tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    c, lay = engine.coords, engine.layout
    state = {**rng.capture(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    shape, index = (lay.pipeline_size, lay.tensor_size, lay.data_size), (c.pp_rank, c.tp_rank, c.dp_rank)
    if lay.context_size > 1:  # CP ranks share (pp, tp, dp): one more coordinate (CP runs only: older keys stay)
        shape, index = (*shape, lay.context_size), (*index, c.cp_rank)
    return ShardedObject("rng_state", state, shape, index, replica_id=0)


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` captured."""
    from megatron.core import tensor_parallel

    rng.restore(state)
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


# -- save --------------------------------------------------------------------------------------------------------------

def meta(engine: "MegatronCore", step: int) -> dict[str, Any]:
    """What the meta file of a checkpoint of ``step`` records besides its files."""
    return {"format": FORMAT, "model_only": step - engine.skipped_steps <= 0,
            "optimizer_steps": step - engine.skipped_steps, "layout": layout_meta(engine)}


class Shards:
    """The bare ``MegatronCore``'s side of a save (``hpc_tools.train.engine.Checkpointable``), synchronous: what a test
    driver hands ``checkpointing.saver.save_once`` (``MegatronJob`` is the trainer's, with background writes)."""

    def __init__(self, engine: "MegatronCore"):
        self.engine = engine

    def start_background_writer(self) -> None:
        """Synchronous saves only."""

    def write_checkpoint(self, folder: Path, step: int, background: bool = False) -> None:
        return write(self.engine, folder, step)

    def checkpoint_meta(self, step: int) -> dict[str, Any]:
        return meta(self.engine, step)


def write(engine: "MegatronCore", folder: Path, step: int, *, background=None):
    """Collective: every rank writes its torch_dist shards of step ``step`` into ``folder`` (which exists).

    ``background`` (a ``BackgroundWriter``): through dist_checkpointing's async path: the
    shards are staged into a host copy now and written by the writer's process; returns the ``engine.Write`` to
    poll. Otherwise synchronous; returns None."""
    from megatron.core import dist_checkpointing

    if background is None:
        _in_process_results_queue()  # unless a BackgroundWriter already set up the library's cross-process queue
    # Before the first step the optimizer has no state to save (the distributed optimizer refuses): model only.
    model_only = step - engine.skipped_steps <= 0
    t0 = time.perf_counter()
    with params_gathered(engine):
        state = model_state(engine)
        if not model_only:
            state["optimizer"] = engine.optimizer.sharded_state_dict(dict(state), is_loading=False,
                                                                     metadata=SHARDING)
            state["rng_state"] = rng_state(engine)
        if background is None:
            dist_checkpointing.save(state, str(folder))
            return None
        background.ready()
        t1 = time.perf_counter()
        request = dist_checkpointing.save(state, str(folder), sharded_strategy=background.strategy,
                                          validate_access_integrity=background.saves == 0, async_sharded_save=True)
        t2 = time.perf_counter()
        write = background.schedule(request)
        write.parts = {"state_dict_s": t1 - t0, "plan_s": t2 - t1, "stage_s": time.perf_counter() - t2}
        return write


class BackgroundWriter:
    """dist_checkpointing's async machinery for one run (built when the saver starts it): an
    ``AsyncCallsQueue`` with the persistent writer process on a GPU (one process for the run's life; Megatron-LM's
    choice; started when this writer is built, on the rank's own device: ``_start_persistent``) and a writer forked
    per save on CPU (the persistent one calls ``torch.cuda.set_device``: it dies on a CPU node and the trainer then
    hangs in finalize). The writer's results come back through the library's multiprocessing Manager queue, started
    in a thread at construction, so that its 2-3 s start overlaps training instead of the first save.

    Staging: the async path copies every tensor to the host (``preload_fn``). For CPU tensors that copy is a no-op,
    so a writer that shares the trainer's memory (a thread, the persistent worker) would write the live parameters
    while the next steps change them. The per-save writer is forked in the save call: its copy-on-write snapshot is
    the real copy, and the tensors it would still share (shared memory) are cloned (``_cloning``).

    The save plan is the same at every save of a run: as Megatron-LM with ``ckpt_assume_constant_structure``, one
    torch_dist strategy with ``cached_metadata`` is kept (the library checks that the plans agree before reusing
    them), and the access-integrity check (an all-gather of every shard's metadata) runs at the first save only."""

    def __init__(self, device_index: int | None):
        import threading

        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
        from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

        self.on_gpu, self.device_index = device_index is not None, device_index
        self.queue = AsyncCallsQueue(persistent=self.on_gpu)
        self.strategy = TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=True)
        self.saves = 0
        self._manager = threading.Thread(target=_start_results_queue, daemon=True, name="ckpt-results-queue")
        self._manager.start()
        if self.on_gpu:
            self._start_persistent()

    def _start_persistent(self) -> None:
        """Start the persistent writer process now, on this rank's own device.

        The library starts it at the first save (importing torch and megatron and opening a CUDA context there:
        10-30 s of that save blocked, and again after each abort) and has it call
        ``torch.cuda.set_device(global_rank % device_count)``: with a cyclic task distribution that is a peer's GPU.
        Its ``async_loop`` uses its ``rank`` argument for that call and for debug log lines only, so it is given
        this rank's local device index (``ctx.device``), the device the trainer itself uses."""
        import logging as _logging
        import multiprocessing as mp

        from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

        caller = self.queue._get_async_caller()  # the queue's one PersistentAsyncCaller
        if caller.process is not None:
            return
        level = _logging.getLogger("megatron.core.dist_checkpointing.strategies.async_utils").getEffectiveLevel()
        caller.process = mp.get_context("spawn").Process(
            target=PersistentAsyncCaller.async_loop,
            args=(self.device_index, caller.queue, caller.preload_q, caller.comp_q, level))
        caller.process.start()

    def ready(self) -> None:
        self._manager.join()

    def schedule(self, request) -> "MegatronWrite":
        if not self.on_gpu and request.preload_fn is not None:
            request = request._replace(preload_fn=_cloning(request.preload_fn))
        if self.on_gpu:
            self._start_persistent()  # after an abort killed it: again on this rank's device, not the library's
        self.queue.schedule_async_request(request)
        self.saves += 1
        return MegatronWrite(self.queue)

    def close(self) -> None:
        for call in list(self.queue.async_calls):
            with _suppress():
                call.async_caller.close(abort=True)
        self.queue.async_calls.clear()
        with _suppress():
            self.queue.close(abort=True)


class MegatronWrite:
    """One scheduled save on the ``BackgroundWriter``'s queue (``hpc_tools.train.engine.Write``)."""

    def __init__(self, queue):
        self.queue = queue
        self.caller = queue.async_calls[-1].async_caller
        self.ended: float | None = None
        self.parts: dict[str, float] = {}
        self._done = False
        process = getattr(self.caller, "process", None)
        if process is not None and not queue.persistent:  # the forked writer: note when it exits
            import threading

            threading.Thread(target=self._watch, args=(process.sentinel,), daemon=True).start()

    def _watch(self, sentinel) -> None:
        import time
        from multiprocessing.connection import wait

        wait([sentinel])
        self.ended = time.perf_counter()

    def done(self) -> bool:
        if self._done:
            return True
        if self.queue.persistent:
            # peek at the worker's completion queue; the library's own check (finish) finds the item kept here
            from queue import Empty

            if self.caller.cur_item is None:
                try:
                    self.caller.cur_item = self.caller.comp_q.get_nowait()
                except Empty:
                    return False
            import time

            self.ended = time.perf_counter()
        else:
            process = self.caller.process
            if process is not None and process.is_alive():
                return False
        self._done = True
        return True

    def finish(self) -> None:
        """Collective: the library's finalize (every rank's write results gathered, torch_dist's metadata written
        by the coordinator); raises (on every rank) when a rank's write failed."""
        self.queue.maybe_finalize_async_calls(blocking=True)

    def abort(self) -> None:
        with _suppress():
            self.caller.close(abort=True)
        self.queue.async_calls.clear()

    def kill(self) -> None:
        import os
        import signal

        process = getattr(self.caller, "process", None)
        if process is not None and process.pid:
            os.kill(process.pid, signal.SIGKILL)


def _cloning(preload_fn):
    """``preload_fn`` (a no-op for CPU tensors) followed by a real copy of the staged CPU tensors that the forked
    writer would otherwise share with the trainer.

    The writer is forked in the save call, after this runs: its memory is a copy-on-write snapshot of the trainer's
    at that moment, so what it writes is the state of the save call even while the next steps change the trainer's
    tensors (each page the trainer writes afterwards is copied for it, once) — except tensors in shared memory
    (``Tensor.is_shared``: a mapping the fork shares instead of copying), which are cloned here. Cloning every tensor
    instead cost ~1 s per save of the 27M-parameter benchmark model on a loaded 2-core machine, most of the
    blocked time."""
    def staged():
        out = []
        for file_name, key, (bytes_data, tensor_data) in preload_fn():
            copied = [(item, t.detach().clone() if t.device.type == "cpu" and t.is_shared() else t)
                      for item, t in tensor_data]
            out.append((file_name, key, (bytes_data, copied)))
        return out

    return staged


def _start_results_queue() -> None:
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if isinstance(filesystem_async._results_queue, queue.Queue):  # a synchronous save's (_in_process_results_queue)
        filesystem_async._results_queue = None
    filesystem_async._get_write_results_queue()


def _suppress():
    import contextlib

    return contextlib.suppress(Exception)


@contextmanager
def params_gathered(engine: "MegatronCore"):
    """The model weights complete while the body runs, whatever ``overlap_param_gather`` deferred.

    With ``overlap_param_gather`` the distributed optimizer's step refreshes only this rank's data-parallel shard of
    each bucket; the all-gather of the rest runs in the next forward's pre-hooks. A checkpoint written before that
    forward would hold (DP-1)/DP of every weight one step stale (each weight is written by one DP replica). As
    Megatron-LM does around its saves: remove the hooks with a synchronous all-gather
    (``disable_forward_pre_hook(param_sync=True)``), then put them back (megatron-core 0.16.1 DDP API).
    """
    hooked = [chunk for chunk in engine.chunks if getattr(chunk, "use_forward_hook", False)]
    for chunk in hooked:
        chunk.disable_forward_pre_hook(param_sync=True)
    try:
        yield
    finally:
        for chunk in hooked:
            chunk.enable_forward_pre_hook()


def _in_process_results_queue() -> None:
    """Give torch_dist's writer a plain in-process queue instead of a spawned multiprocessing Manager.

    The Manager only matters for asynchronous saves (results travel from a background process); a synchronous save's
    results are put and read in this process. Skipping it saves seconds per rank at the first save and the spawn's
    re-import of __main__. Once a ``BackgroundWriter`` has started the Manager queue, synchronous saves use it too.
    """
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


# -- load --------------------------------------------------------------------------------------------------------------

def load(engine: "MegatronCore", path: str | Path) -> int:
    """Restore what the checkpoint at ``path`` allows under this engine's layout; returns its step."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    meta = CheckpointDirs.read_meta(path)
    if meta.get("format") != FORMAT:
        from hpc_tools.errors import UserError

        raise UserError(f"checkpoint {path} was not written by the megatron backend (format {meta.get('format')!r}; "
                        "point checkpoint.load_path at a megatron checkpoint)")
    saved, here = meta["layout"], layout_meta(engine)
    check_vocab(path, saved, here, engine.recipe.model.vocab_size)
    check_layers(path, saved, here)
    why = None if meta["model_only"] else why_not(saved, here)
    if why is not None:  # refused before anything is loaded (validate and submit say so for checkpoint.load_path)
        from hpc_tools.errors import UserError

        raise UserError(f"checkpoint {path} cannot carry its optimizer state into this layout: {why} (train in the "
                        "layout it was saved under, or export it with `hpc_tools export` and start from its weights "
                        "with checkpoint.init_from_hf)")
    with_optimizer = not meta["model_only"]
    with_rng = with_optimizer and all(_size(saved, k) == _size(here, k) for k in
                                      ("tensor_size", "pipeline_size", "virtual_pipeline_size", "data_size",
                                       *DEFAULT_SIZES))
    state = model_state(engine)
    if with_optimizer:
        _prefill_optimizer(engine)
        state["optimizer"] = engine.optimizer.sharded_state_dict(dict(state), is_loading=True, metadata=SHARDING)
    if with_rng:
        state["rng_state"] = rng_state(engine)
    loaded = dist_checkpointing.load(state, str(path))
    from hpc_tools.train.megatron.model import unwrap

    for i, chunk in enumerate(engine.chunks):
        unwrap(chunk).load_state_dict(loaded[f"model{i}"], strict=True)
    if with_optimizer:
        import torch

        with torch.no_grad():  # fp32 shards are views of leaf params: copying into them must not be recorded
            engine.optimizer.load_state_dict(loaded["optimizer"])
        _restore_adam_steps(engine, int(meta["optimizer_steps"]))
        engine.skipped_steps = int(meta["step"]) - int(meta["optimizer_steps"])
    else:
        # Master weights of the 16-bit optimizers are copies of the params made at construction: refresh them.
        _reload_main_params(engine)
    if with_rng:
        set_rng_state(loaded["rng_state"])
    return int(meta["step"])


def check_vocab(path: Path, saved: dict[str, Any], here: dict[str, Any], vocab_size: int) -> None:
    """The embedding's global shape must match: Megatron pads the vocabulary to a multiple of 128 x tensor_size."""
    from hpc_tools.errors import UserError

    old, new = saved.get("padded_vocab_size"), here["padded_vocab_size"]
    if old is not None and old != new:
        multiple = 128 * saved["tensor_size"] * here["tensor_size"]
        raise UserError(f"model.vocab_size={vocab_size} pads to {new} rows under parallel.tensor_size="
                        f"{here['tensor_size']} but checkpoint {path} (tensor_size={saved['tensor_size']}) has {old} "
                        f"(train with a vocab_size that is a multiple of {multiple} to change tensor_size, or keep "
                        f"tensor_size={saved['tensor_size']})")


def check_layers(path: Path, saved: dict[str, Any], here: dict[str, Any]) -> None:
    """The layer kind must match: Transformer Engine's layers name their parameters otherwise than the local ones
    (the input norm fused into ``linear_qkv``/``linear_fc1``) and add ``_extra_state`` entries, so a checkpoint of the
    other kind fails in dist_checkpointing with "Missing key". A checkpoint without the record (written before it
    existed, on CPU: local layers) is not checked."""
    from hpc_tools.errors import UserError

    old, new = saved.get("layers"), here["layers"]
    if old is not None and old != new:
        impl = "local" if old == "local" else "transformer_engine"
        raise UserError(f"checkpoint {path} holds {old} layers but this run builds {new} layers (see the start line; "
                        f"set backend.megatron.transformer_impl: {impl} to resume it on this node)")


def step_in_param_state(inner) -> bool:
    """Where this inner optimizer keeps Adam's step count.

    torch's Adam/AdamW (megatron-core's fallback when neither Transformer Engine nor apex imports) keep it per
    parameter, ``state[p]["step"]`` (a tensor). TE's and apex's FusedAdam keep it per parameter group,
    ``group["step"]`` (an int), and TE's ``FusedAdam.state_dict()``/``load_state_dict()`` pass every per-parameter key
    through ``name_to_dtype_map`` (``exp_avg``, ``exp_avg_sq``, ``master_param``): a per-parameter ``step`` there
    raises ``KeyError`` on the next save or load (docs/megatron-on-cpu.md).
    """
    import torch

    return isinstance(inner, (torch.optim.Adam, torch.optim.AdamW))


def _prefill_optimizer(engine: "MegatronCore") -> None:
    # A fresh torch AdamW has no state tensors to load into; allocate them, with a placeholder step that the
    # distributed optimizer's state_dict() insists on (torch's per-parameter step only). Without the pre-fill the
    # resumed losses drift from the uninterrupted run (observed with megatron-core 0.16.1; the resume cases of
    # test_megatron_layouts check it).
    import torch

    for opt in inner_optimizers(engine.optimizer):
        init = getattr(opt, "init_state_fn", None)
        if init is not None:
            init(opt.optimizer, opt.config)
        if not step_in_param_state(opt.optimizer):
            continue
        for group in opt.optimizer.param_groups:
            for param in group["params"]:
                state = opt.optimizer.state[param]
                if "exp_avg" in state and "step" not in state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)


def _restore_adam_steps(engine: "MegatronCore", steps: int) -> None:
    """Adam's step count (bias correction) = optimizer steps taken before the checkpoint, where the optimizer keeps
    it: per parameter (torch) or per parameter group (TE/apex FusedAdam, an int; ``step_in_param_state``)."""
    import torch

    for opt in inner_optimizers(engine.optimizer):
        inner = opt.optimizer
        per_param = step_in_param_state(inner)
        for group in inner.param_groups:
            if not per_param:
                group["step"] = int(steps)  # FusedAdam passes it to its kernel as an int
                continue
            for param in group["params"]:
                state = inner.state[param]
                if "exp_avg" in state:
                    state["step"] = torch.tensor(float(steps), dtype=torch.float32)


def _reload_main_params(engine: "MegatronCore") -> None:
    for opt in inner_optimizers(engine.optimizer):
        reload = getattr(opt, "reload_model_params", None)
        if reload is not None:
            reload()
