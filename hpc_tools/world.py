"""A resolved recipe checked against the world it will meet: the files it names on this machine, and the live Slurm
cluster (``sinfo``) it would be submitted to.

``validate`` and ``submit`` call ``world_violations``; the recipe's own rules (``recipe/rules/``) and the planner's
memory fit run first, so these checks see a coherent recipe. Every problem is one ``Violation`` naming the field,
collected all at once. Slurm is asked once per process with a short timeout (``SLURM_TIMEOUT_S``): a controller that
does not answer means "not checked against Slurm", never an error and never a long wait. The Slurm figures a job asks
for (nodes, GPUs and tasks per node, CPUs per task, minutes) come from ``render/slurm_params.py`` ``SlurmSpec``, the
owner of the sbatch flags, so the check reads exactly what ``sbatch`` will be given.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hpc_tools import slurm_client
from hpc_tools.errors import UserError, Violation
from hpc_tools.slurm_client import absent_reason

if TYPE_CHECKING:
    from hpc_tools.recipe.schema import Recipe
    from hpc_tools.topology import Topology

SLURM_TIMEOUT_S = 3.0  # sinfo answers in tens of ms; a controller that is down makes it retry for a minute
SINFO_FORMAT = "%P|%a|%l|%s|%G|%c|%N"  # partition (default has *), avail, MaxTime, job size, gres, CPUs, node
LOCAL_IMAGE_SUFFIXES = (".sqsh", ".squashfs", ".sif", ".simg")  # enroot/pyxis squashfs, apptainer images
_GPU_GRES = re.compile(r"(?:^|,)gpu(?::[^:,()]+)?:(\d+)")


@dataclass(frozen=True, slots=True)
class Partition:
    """One Slurm partition as ``sinfo`` reports it (per-node figures are the smallest over its nodes)."""

    name: str
    default: bool
    available: str  # up, down, drain, inact
    max_time_min: float | None  # None: no limit ("infinite")
    max_nodes: int | None  # largest job, in nodes; None: no limit
    nodes: int
    gpus_per_node: int  # 0: no GPU gres on some node
    cpus_per_node: int
    gres: str  # as sinfo shows it, for messages


@dataclass(frozen=True, slots=True)
class SlurmView:
    """The partitions of the reachable Slurm cluster, or why they are unknown (``partitions`` is None)."""

    partitions: tuple[Partition, ...] | None
    why: str = ""  # "not checked" reason: Slurm not installed, not answering, unreadable output
    absent: bool = False  # no Slurm here (sinfo not on PATH, or HPC_TOOLS_SLURM=off): normal, nothing to note

    @property
    def checked(self) -> bool:
        return self.partitions is not None

    def find(self, name: str | None) -> Partition | None:
        """The partition ``name``, or the default partition for None."""
        for p in self.partitions or ():
            if (p.name == name) if name else p.default:
                return p
        return None

    def summary(self) -> str:
        """One line for --verbose and doctor: what was checked, or why not."""
        if not self.checked:
            return f"not checked against Slurm: {self.why}"
        names = ", ".join(p.name + (" (default)" if p.default else "") for p in self.partitions)
        return f"checked against Slurm partitions: {names or 'none'}"


def run_sinfo(timeout_s: float = SLURM_TIMEOUT_S) -> tuple[str | None, str]:
    """(``sinfo``'s text, one line per node and partition, ""), or (None, why it did not answer)."""
    answer = slurm_client.sinfo(["--noheader", "--Node", f"--format={SINFO_FORMAT}"], timeout_s)
    return answer.out if answer.ok else None, sinfo_reason(answer)


def sinfo_reason(answer) -> str:
    """Why sinfo gave no partitions, for a note: no Slurm here, or Slurm unreachable (its last line)."""
    if answer.ok:
        return ""
    if answer.kind == slurm_client.NOT_INSTALLED:
        return f"no Slurm here ({answer.said})"
    return f"Slurm unreachable ({answer.said})"


@functools.lru_cache(maxsize=1)
def slurm_view(timeout_s: float = SLURM_TIMEOUT_S) -> SlurmView:
    """The live cluster's partitions (asked once per process), or why they could not be read."""
    absent = absent_reason("sinfo")
    if absent:
        return SlurmView(None, f"no Slurm here ({absent})", absent=True)
    text, why = run_sinfo(timeout_s)
    if text is None:
        return SlurmView(None, why)
    try:
        return SlurmView(parse_sinfo(text))
    except ValueError as exc:
        return SlurmView(None, f"sinfo output not understood ({exc})")


@functools.lru_cache(maxsize=1)
def live_topology(timeout_s: float = SLURM_TIMEOUT_S) -> "Topology | str":
    """The live cluster's network (``scontrol show topology``, tree or block plugin; asked once per process), or
    why there is none (a string: no Slurm here, no answer, no topology plugin)."""
    from hpc_tools.topology import read_live

    absent = absent_reason("scontrol")
    if absent:
        return f"no Slurm here ({absent})"
    return read_live(timeout_s)


def parse_sinfo(text: str) -> tuple[Partition, ...]:
    """Partitions from ``sinfo --noheader --Node --format=SINFO_FORMAT`` (one line per node and partition)."""
    rows: dict[str, list[list[str]]] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = line.split("|")
        if len(fields) != 7:
            raise ValueError(f"line {line[:80]!r} has {len(fields)} fields, not 7")
        rows.setdefault(fields[0], []).append(fields)
    parts = []
    for label, nodes in rows.items():
        _, avail, limit, size, _, _, _ = nodes[0]
        gres = sorted({n[4] for n in nodes})
        parts.append(Partition(
            name=label.rstrip("*"), default=label.endswith("*"), available=avail, max_time_min=_minutes(limit),
            max_nodes=_job_size_max(size), nodes=len({n[6] for n in nodes}),
            gpus_per_node=min(gres_gpus(n[4]) for n in nodes), cpus_per_node=min(_int(n[5]) for n in nodes),
            gres=",".join(g for g in gres if g != "(null)") or "none"))
    return tuple(parts)


def gres_gpus(gres: str) -> int:
    """GPUs in a node's gres string (``gpu:8``, ``gpu:h100:4(S:0-1)``, ``(null)``)."""
    return sum(int(m.group(1)) for m in _GPU_GRES.finditer(gres))


def _minutes(limit: str) -> float | None:
    from hpc_tools.recipe.cluster import time_limit_minutes

    if limit in ("infinite", "UNLIMITED", "n/a", "NONE"):
        return None
    return time_limit_minutes(limit)


def _job_size_max(size: str) -> int | None:
    top = size.rsplit("-", 1)[-1]
    return None if top in ("infinite", "UNLIMITED") else _int(top)


def _int(text: str) -> int:
    digits = re.match(r"\d+", text.strip())
    if not digits:
        raise ValueError(f"{text!r} is not a count")
    return int(digits.group())


# --- the checks ----------------------------------------------------------------------------------------------------


def world_violations(recipe: Recipe, slurm: bool = True, view: SlurmView | None = None) -> list[Violation]:
    """Every way ``recipe`` does not fit this machine's files and (with ``slurm``) the live Slurm cluster."""
    found = path_violations(recipe) + package_violations(recipe)
    if slurm:
        view = view or slurm_view()
        if view.checked:
            found += slurm_violations(recipe, view)
    return found


def path_violations(recipe: Recipe) -> list[Violation]:
    """The local paths the recipe names that the job will need and that are missing here. Relative paths are read
    from the current folder, as the job reads them from the folder `submit` ran in."""
    found: list[Violation] = []
    data = recipe.data
    if data.source == "files":
        for i, raw in enumerate(data.paths):
            if not _path(raw).exists():
                found.append(Violation(f"data.paths[{i}]", raw, "does not exist",
                                       "give an existing file or folder (relative paths are read from the current "
                                       "folder; nothing is downloaded)"))
    if data.source == "indexed":
        found += indexed_violations(recipe)
    if data.tokenizer != "byte" and not _path(data.tokenizer).is_dir():
        found.append(Violation("data.tokenizer", data.tokenizer, "is neither `byte` nor an existing folder",
                               "give the folder of a saved Hugging Face tokenizer, or `byte`"))
    ck = recipe.checkpoint
    if ck.load_path and not _path(ck.load_path).exists():
        found.append(Violation("checkpoint.load_path", ck.load_path, "does not exist",
                               "give an iter_N checkpoint folder or a folder of them, or remove load_path"))
    elif ck.load_path:
        found += load_path_violations(recipe)
    if ck.init_from_hf and not _path(ck.init_from_hf).is_dir():
        found.append(Violation("checkpoint.init_from_hf", ck.init_from_hf, "is not an existing folder",
                               "give a local Hugging Face model folder (config.json and weights); nothing is "
                               "downloaded"))
    elif ck.init_from_hf:
        found += _hf_folder_violations(recipe)
    container = recipe.cluster.setup.container
    if container and is_local_image(container.image) and not _path(container.image).is_file():
        found.append(Violation("cluster.setup.container.image", container.image, "is not an existing image file",
                               "give the path of the .sqsh/.sif file, or a registry reference (e.g. "
                               "nvcr.io#nvidia/pytorch:24.05-py3 for pyxis, docker://... for apptainer)"))
    return found


def load_path_violations(recipe: Recipe) -> list[Violation]:
    """A Megatron checkpoint at ``checkpoint.load_path`` whose optimizer state this recipe's layout cannot load
    (``hpc_tools.checkpoints.reshard``): refused here, before a job is queued, rather than on the ranks."""
    from hpc_tools import backends
    from hpc_tools.checkpoints.dirs import CheckpointDirs, resume_source
    from hpc_tools.checkpoints.reshard import MEGATRON_FORMAT, layout_sizes, size, why_not
    from hpc_tools.layout import ParallelLayout

    if not backends.of(recipe).checks_load_layout:
        return []
    try:  # the checkpoint the run would load (the trainer's own rule); none complete: the loader says so
        source = resume_source(CheckpointDirs(recipe.checkpoint.load_path), resume=False,
                               load_path=recipe.checkpoint.load_path)
        meta = CheckpointDirs.read_meta(source) if source is not None else {}
    except (UserError, OSError, ValueError):
        return []
    saved = meta.get("layout")
    if not isinstance(saved, dict) or meta.get("model_only") or meta.get("format") != MEGATRON_FORMAT:
        return []
    here = layout_sizes(ParallelLayout.from_recipe(recipe), recipe.backend.megatron.distributed_optimizer,
                        recipe.training.precision)
    try:
        why = why_not(saved, here)
    except (KeyError, TypeError):  # a meta without the layout record: the loader decides
        return []
    if why is None:
        return []
    keep = ", ".join(f"parallel.{k}={size(saved, k)}" for k in ("tensor_size", "pipeline_size", "context_size",
                                                                 "expert_size") if size(saved, k) != here.get(k))
    return [Violation("checkpoint.load_path", recipe.checkpoint.load_path, f"holds {source.name}, whose optimizer "
                      f"state cannot be loaded into this layout: {why}",
                      f"train in the layout it was saved under ({keep or 'its sizes'}; "
                      f"distributed_optimizer {str(saved['distributed_optimizer']).lower()}), or export it with "
                      "`hpc_tools export` and start from its weights with checkpoint.init_from_hf")]


HOROVOD_INSTALL = "bash environment/install-horovod.sh"
"""Builds Horovod once against the installed torch and caches the wheel (the package index has only its source)."""


def horovod_problem() -> str | None:
    """Why ``import horovod.torch`` cannot work in this Python, found without importing it (torch stays unloaded):
    Horovod is not installed, or without its PyTorch extension; None when both are there (whether the extension
    loads with this torch is doctor's question)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("horovod")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return "Horovod is not installed in this Python"
    if not any(next(Path(where, "torch").glob("mpi_lib_v2*.so"), None) for where in spec.submodule_search_locations):
        return "Horovod is installed without its PyTorch extension (horovod/torch/mpi_lib_v2*.so)"
    return None


def package_violations(recipe: Recipe) -> list[Violation]:
    """A package the recipe's backend needs that no install step brings: Horovod (environment/install.sh leaves it
    out: it builds for minutes). Checked in this Python only when the job runs in it (no venv, conda_env or
    container in cluster.setup)."""
    from hpc_tools import backends

    setup = recipe.cluster.setup
    if "horovod" not in backends.of(recipe).packages or setup.venv or setup.conda_env or setup.container:
        return []
    why = horovod_problem()
    if why is None:
        return []
    return [Violation("backend.kind", "horovod", f"needs Horovod with its PyTorch extension: {why}",
                      f"run {HOROVOD_INSTALL} (builds it once against this torch, about 3 minutes on 2 cores; "
                      "the wheel is cached)")]


def indexed_violations(recipe: Recipe) -> list[Violation]:
    """``data.blend`` prefixes whose ``PREFIX.bin`` / ``PREFIX.idx`` pair is incomplete here."""
    from hpc_tools.data.prepare import bin_path, idx_path

    found = []
    for i, entry in enumerate(recipe.data.blend):
        files = {".bin": bin_path(_path(entry.path)), ".idx": idx_path(_path(entry.path))}
        missing = [suffix for suffix, path in files.items() if not path.is_file()]
        if missing:
            found.append(Violation(f"data.blend[{i}].path", entry.path, f"has no {' or '.join(missing)} file",
                                   "prepare it (python -m hpc_tools data prepare) or fix the prefix (PREFIX.bin and "
                                   "PREFIX.idx must both exist)"))
    return found


def is_local_image(image: str) -> bool:
    """True when a container image names a file on disk (a path, or an image file's suffix), not a registry
    reference (``docker://...``, ``nvcr.io#nvidia/pytorch:...``, ``ubuntu:22.04``)."""
    if "://" in image or "#" in image:
        return False
    return image.startswith(("/", "./", "../", "~")) or image.endswith(LOCAL_IMAGE_SUFFIXES)


def _nodes_violation(recipe: Recipe, asked: int, limit: int, what: str) -> Violation:
    """The job asks ``asked`` nodes (the layout's plus the spares), over ``limit``: named by the value the recipe
    wrote (cluster.nodes, or cluster.spare_nodes when the spares make the difference), with a fix that is not already
    true."""
    c = recipe.cluster
    if c.spare_nodes and asked - c.spare_nodes <= limit:
        return Violation("cluster.spare_nodes", c.spare_nodes, f"with cluster.nodes={c.nodes} asks for {asked} "
                         f"nodes, beyond {what}", f"use at most {limit - (asked - c.spare_nodes)} spare nodes, "
                         "or another partition" if limit > asked - c.spare_nodes else
                         "use spare_nodes: 0 (no in-job node replacement), fewer nodes, or another partition")
    room = limit - c.spare_nodes
    with_spares = f"with cluster.spare_nodes={c.spare_nodes} ({asked} nodes in all) " if c.spare_nodes else ""
    return Violation("cluster.nodes", c.nodes, f"{with_spares}exceeds {what}",
                     f"use at most {room} nodes, or another partition" if room >= 1 else
                     f"use spare_nodes: 0 and at most {limit} nodes, or another partition")


def slurm_violations(recipe: Recipe, view: SlurmView) -> list[Violation]:
    """What the live cluster would refuse or never start: a missing partition, too few nodes, GPUs or CPUs per node,
    a time limit above the partition's."""
    from hpc_tools.render.slurm_params import SlurmSpec

    spec = SlurmSpec.from_recipe(recipe)
    part = view.find(spec.partition)
    if part is None:
        names = ", ".join(p.name + (" (the default)" if p.default else "") for p in view.partitions) or "none"
        if spec.partition:
            return [Violation("cluster.partition", spec.partition, "is not a partition of this Slurm cluster",
                              f"use one of: {names}")]
        return [Violation("cluster.partition", ..., "is unset and this Slurm cluster has no default partition",
                          f"set one of: {names}")]
    where = f"partition {part.name}"
    found = []
    limit = part.max_nodes if part.max_nodes is not None and spec.nodes > part.max_nodes else \
        part.nodes if spec.nodes > part.nodes else None
    if limit is not None:
        found.append(_nodes_violation(recipe, spec.nodes, limit, f"the {part.max_nodes}-node job limit of {where}"
                                      if limit == part.max_nodes else f"the {part.nodes} nodes of {where}"))
    if spec.gpus_per_node and spec.gpus_per_node > part.gpus_per_node:
        have = f"{part.gpus_per_node} GPUs per node" if part.gpus_per_node else "no GPUs (gres: none)"
        found.append(Violation("cluster.gpus_per_node", spec.gpus_per_node, f"exceeds {where}: it has {have}",
                               "use a GPU partition or fewer GPUs per node" if part.gpus_per_node else
                               "use a GPU partition, or cluster.gpu_type: cpu for CPU ranks"))
    cpus = spec.ntasks_per_node * spec.cpus_per_task
    if cpus > part.cpus_per_node:
        found.append(Violation("cluster.cpus_per_task", spec.cpus_per_task,
                               f"x {spec.ntasks_per_node} ranks per node = {cpus} CPUs exceeds the "
                               f"{part.cpus_per_node} CPUs per node of {where}",
                               f"use at most {max(1, part.cpus_per_node // spec.ntasks_per_node)} CPUs per rank"))
    if part.max_time_min is not None and recipe.cluster.time_limit_min > part.max_time_min:
        found.append(Violation("cluster.time_limit", recipe.cluster.time_limit,
                               f"exceeds the time limit of {where} ({_hms(part.max_time_min)})",
                               f"use at most {_hms(part.max_time_min)}, or another partition"))
    return found


def _hms(minutes: float) -> str:
    """Minutes as Slurm's D-HH:MM:SS / HH:MM:SS."""
    total = round(minutes * 60)
    days, rest = divmod(total, 86400)
    text = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}-{text}" if days else text


def _path(raw: str) -> Path:
    return Path(os.path.expanduser(raw))


def _hf_folder_violations(recipe: "Recipe") -> list[Violation]:
    """checkpoint.init_from_hf against the recipe before anything is queued: the folder's config.json is the
    recipe's architecture and shape (the check the ranks make again when they load it; config.json only, no torch)."""
    from hpc_tools.errors import UserError
    from hpc_tools.hf.load import read_config

    folder = recipe.checkpoint.init_from_hf
    try:
        read_config(_path(folder), recipe.model)
    except UserError as e:
        # read_config's line without its field prefix and its own fix: "PATH has n_layer=3 (model.num_layers=...)"
        reason = str(e).split(": ", 1)[-1].split("; the folder is")[0].rsplit(" (give", 1)[0]
        return [Violation("checkpoint.init_from_hf", folder, reason,
                          "give a folder of this model, or set the recipe's model section to the folder's")]
    return []
