"""The checkpoints of a Hugging Face causal LM through torch Distributed Checkpoint (DCP), whatever spreads it.

A checkpoint folder ``iter_N/`` holds ``dcp/`` (DCP's ``.metadata`` and one ``__<rank>_0.distcp`` per writing rank:
model and optimizer, each rank its shards; DDP's replicated tensors written once), ``rng_rank<R>.pt`` (each rank's
generators, ``hpc_tools.train.rng``) and the meta file (step = the data position: batches are a pure function of
the step). The state dicts come from ``torch.distributed.checkpoint.state_dict.get_state_dict``: parameter names are
the Hugging Face ones whatever the strategy, so a checkpoint loads at another rank count, strategy or backend (DCP
reshards on load: saved at 4 ranks, resumed at 2; full_shard -> ddp; Horovod -> FSDP) and ``export`` reads it
without ranks.

``checkpoint.async_save``: ``start_async_save`` stages the state into host memory and writes it in a background
thread over a process group of its own (gloo), so its collectives never interleave with training's; the
``hpc_tools.train.checkpointing.saver.Saver`` (the mechanism every backend shares) commits the folder once every
rank's write is done (``FutureWrite``).
"""

from __future__ import annotations

from pathlib import Path

DCP_DIR = "dcp"
RNG_FILE = "rng_rank{rank:05d}.pt"


def _state(model, optimizer):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd}


def save(folder: Path, model, optimizer, rank: int) -> None:
    """Collective: write the model and optimizer shards and this rank's RNG state into ``folder``."""
    import torch
    import torch.distributed.checkpoint as dcp

    from hpc_tools.train import rng

    dcp.save(_state(model, optimizer), checkpoint_id=str(folder / DCP_DIR))
    torch.save(rng.capture(), folder / RNG_FILE.format(rank=rank))


def start_async_save(folder: Path, model, optimizer, rank: int, group, stager):
    """Collective over ``group``: stage the model and optimizer shards into host memory (``stager``: pinned on a
    GPU) and return the future of their write, which goes on in a background thread; this rank's RNG state is
    written at once. The caller commits the folder only after every rank's future is done."""
    import torch
    import torch.distributed.checkpoint as dcp

    from hpc_tools.train import rng

    torch.save(rng.capture(), folder / RNG_FILE.format(rank=rank))
    return dcp.async_save(_state(model, optimizer), checkpoint_id=str(folder / DCP_DIR), process_group=group,
                          async_stager=stager)


class FutureWrite:
    """DCP's background write of one checkpoint as ``hpc_tools.train.engine.Write``."""

    def __init__(self, future):
        self.future, self.ended = future, None
        future.add_done_callback(self._end)

    def _end(self, _future) -> None:
        import time

        self.ended = time.perf_counter()

    def done(self) -> bool:
        return self.future.done()

    def finish(self) -> None:
        self.future.result()  # raises a failed write here, before the folder could be committed

    def abort(self) -> None:
        try:
            self.future.result()  # a thread cannot be killed: wait for it; the folder is never committed
        except Exception:  # noqa: BLE001 - closing after another error: the write's own error is not the news
            pass

    def kill(self) -> None:
        """A writer thread cannot be killed (the kill injection is for the process writers)."""


def async_stager(pin_memory: bool):
    """DCP's default stager, with page-locked host buffers on a GPU (the device-to-host copy then runs at full
    PCIe speed); kept for the engine's life."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(StagingOptions(pin_memory, False, False, False))


def load(folder: Path, model, optimizer, rank: int) -> None:
    """Collective: read ``folder`` into the model and optimizer as they are sharded now (any rank count or
    strategy), and this rank's RNG state when the save had this rank."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from hpc_tools.train import rng

    state = _state(model, optimizer)  # a fresh optimizer's states are created (zeros) so that DCP can fill them
    dcp.load(state, checkpoint_id=str(folder / DCP_DIR))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rng_file = folder / RNG_FILE.format(rank=rank)
    if rng_file.is_file():
        rng.restore(torch.load(rng_file, weights_only=False))


def full_model_state(folder: Path, template: dict) -> dict:
    """The model's full (unsharded) tensors from a checkpoint, read in this one process without ranks: ``template``
    is a plain ``model.state_dict()`` of the same architecture, filled in place and returned."""
    import warnings

    import torch.distributed.checkpoint as dcp

    state = {"model": template}
    with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(folder / DCP_DIR), no_dist=True)
    return state["model"]
