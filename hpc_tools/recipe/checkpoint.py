"""``checkpoint:`` — saving and resuming."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from hpc_tools.recipe.base import Section


class CheckpointConfig(Section):
    dir: str | None = None
    """Checkpoint folder; null = `checkpoints/` inside the run folder."""
    interval_iters: int = Field(default=0, ge=0)
    """Save every N steps; 0 = only at the end and on preemption."""
    keep_last: int = Field(default=2, gt=0)
    """Complete checkpoints kept; older ones are deleted after a newer one is complete (folders set aside as bad
    are never deleted and do not count)."""
    resume: bool = True
    """Resume from the newest complete checkpoint in `dir` when one exists (requeued jobs rely on this)."""
    load_path: str | None = None
    """A checkpoint to start from when `dir` has none (e.g. saved under another layout)."""
    init_from_hf: str | None = None
    """A local Hugging Face model folder (config.json + model.safetensors, e.g. written by `export`) of the recipe's
    architecture and shape whose weights start a Megatron run: continued pretraining from step 0 with a fresh
    optimizer, in any layout. Ignored when the run has a checkpoint to resume from (its own or `load_path`)."""
    async_save: bool = False
    """Write checkpoints in the background (backends whose row has async_save: megatron through
    dist_checkpointing's async save, fsdp through torch Distributed Checkpoint's; deepspeed refuses it): the state is
    staged to a host copy, training goes on while it is written, and the checkpoint becomes complete (`latest`) only
    once every rank's write and its file records (sizes, checksums) are done. A write that fails or is killed is
    never committed (the previous checkpoint stays `latest`). The save of the last step or of a stop is synchronous,
    after the outstanding background write is committed."""
    local_dir: str | None = None
    """A node-local checkpoint tier (e.g. `/tmp/$SLURM_JOB_ID/ckpt` on each node's own disk, or a local NVMe
    scratch; environment variables and `~` expanded on the rank at run time): saves every `local_interval_iters`
    steps go there, cheap and often; the saves every `interval_iters` (and the last and stop saves) still go to `dir`,
    the durable shared tier. A resume takes the newest complete, verified checkpoint of either tier. A local disk that
    is full (or unwritable) makes that save go to `dir` instead, told in one log line. On several nodes each node
    keeps its own ranks' files (and, with `local_replicate`, the previous node's); a resume from this tier first
    copies to every node the files it lacks (a spare or wiped node: all of them). A folder that several nodes see as
    one (a shared file system) turns the tier off, told in one log line."""
    local_replicate: bool = True
    """Copy each node's files of a local-tier save to the next node (node i to i+1, over the network), in the
    background once the save is complete, so that a node whose disk is lost (or a spare that replaces it) loses nothing;
    a copy is used for recovery only once whole. The next local save and the end of the run wait for it."""
    local_replicate_interface: str | None = None
    """The network interface (Linux name, e.g. `ib0`, `hsn0`, `eth1`; several comma-separated, as torch's
    GLOO_SOCKET_IFNAME takes) the local tier's copies travel on: give the fast fabric's. null = the interface the
    host name resolves to."""
    local_interval_iters: int = Field(default=0, ge=0)
    """Save to `local_dir` every N steps (0 = never; needs `local_dir`). A step due on both tiers saves to `dir`."""
    verify: Literal["checksum", "size"] = "checksum"
    """What a resume checks before loading, every rank a share of the files: `checksum` = each file's size and
    xxh3-64 checksum recorded at save (~5 GB/s per rank), `size` = sizes only (no checksums computed at save either).
    A checkpoint that fails is set aside as `iter_N.bad-<reason>` and the run falls back to the previous one."""
