"""The torch.distributed process groups a job creates beside the world (Megatron's parallel state, DeepSpeed's,
a device mesh), ended with the job.

In a training run the world ends with the process and its groups with it. A harness that runs many jobs in one
process group (the tests' layout matrices, ``hpc_tools.testing``) would otherwise keep every job's groups: each gloo
group holds its own transport threads (two per group and peer: ``pt_gloo_runloop``, ``gloo_tcp_loop``), so a matrix of
thirty Megatron layouts ended with ~900 threads per rank, hundreds of them runnable, slowing every process on the
machine. ``snapshot()`` before a job creates its groups and ``destroy_since(before)`` once it has let go of them.
"""

from __future__ import annotations


def _pg_map() -> dict:
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
    except ImportError:
        return {}
    if not (dist.is_available() and dist.is_initialized()):
        return {}
    world = getattr(c10d, "_world", None)
    return dict(getattr(world, "pg_map", {}) or {})


def snapshot() -> frozenset:
    """The process groups that exist now (empty without torch.distributed)."""
    return frozenset(_pg_map())


def destroy_since(before: frozenset) -> int:
    """Destroy every process group created after ``before`` was taken (never the world); returns how many."""
    import torch.distributed as dist

    new = [pg for pg in _pg_map() if pg not in before and pg is not dist.group.WORLD]
    for pg in new:
        dist.destroy_process_group(pg)
    return len(new)


def alive(pg) -> bool:
    """Whether ``pg`` is still a live process group (not destroyed)."""
    return pg in _pg_map()
