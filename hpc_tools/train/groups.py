"""The torch.distributed process groups a job creates beside the world (Megatron's parallel state, DeepSpeed's,
a device mesh), destroyed when the job ends.

In a training run the world ends with the process and its groups with it. A harness that runs many jobs in one
process group (the tests' layout matrices, ``hpc_tools.testing``) would otherwise keep every job's groups, and each
gloo group holds its own transport threads (``pt_gloo_runloop``, ``gloo_tcp_loop``). ``snapshot()`` is taken before
a job creates its groups, and ``destroy_since(before)`` is called once the job has let go of them. The threads end
when nothing refers to the group any more (``tests/unit/test_process_groups.py``).

A Megatron engine's close first lets go of its model (``megatron.engine.MegatronCore._release_model``): Megatron's DDP
hooks on autograd's C++ nodes would otherwise keep the model, and the groups its modules hold, alive to the end.
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


_generation = 0


def generation() -> int:
    """How many times ``destroy_since`` has run in this process: a cache of groups (``node_tier.Nodes``) keyed on it
    is rebuilt after a job's groups were destroyed. Every rank calls ``destroy_since`` at the same points, so every
    rank counts the same (a rank outside a group holds no entry for it, so the groups each destroys differ)."""
    return _generation


def destroy_since(before: frozenset) -> int:
    """Destroy every process group created after ``before`` was taken (never the world); returns how many."""
    import torch.distributed as dist

    global _generation
    _generation += 1
    new = [pg for pg in _pg_map() if pg not in before and pg is not dist.group.WORLD]
    for pg in new:
        dist.destroy_process_group(pg)
    return len(new)
