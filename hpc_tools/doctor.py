"""``doctor``: does this machine or cluster have what a job needs? One ``Check`` per fact, each pass / warn / fail /
skip with a one-line detail and, for anything not passing, the fix.

The checks: the Python version (``setup.cfg`` python_requires), the packages a job imports against the pins in
``environment/`` (requirements files and install.sh), torch's CUDA / driver / NCCL when present, the Megatron GPU
path's libraries (Transformer Engine against megatron-core's accepted range, apex, flash-attn) and, for NVMe offload,
DeepSpeed's async_io op, Slurm answering
(``hpc_tools/world.py``, the same 3 s question ``validate`` asks), and with a recipe: its checks against the files it
names and the live partition (the same ``world_violations``), the container runtime it asks for, and a writable runs
folder (``submission.checked_runs_root``). torch is imported inside its check only (seconds; fine here, never on a
light command).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from hpc_tools import backends
from hpc_tools.render import launchers
from hpc_tools.world import HOROVOD_INSTALL

if TYPE_CHECKING:
    from hpc_tools.recipe.schema import Recipe

REPO = Path(__file__).resolve().parents[1]
ENVIRONMENT = REPO / "environment"
STATUSES = ("pass", "warn", "fail", "skip")
# The packages a job imports: every job's (or the tools around it), then each backend's (its row's ``packages``),
# then the Hugging Face ``datasets``, which only reads inputs: a recipe's ``data.source: files``
# (hpc_tools/train/data.py reads them through it) and ``data prepare`` of a saved dataset (hpc_tools/data/inputs.py).
EVERY_JOB = ("torch", "submitit", "pandas", "pyarrow")
FILE_INPUTS = ("datasets",)
FILE_INPUTS_WHY = "data.source: files and `data prepare` (Hugging Face inputs)"
PACKAGES: dict[str, tuple[str, ...]] = {name: () for name in EVERY_JOB[:1]}  # name -> the kinds that need it
for _row in backends.BACKENDS.values():
    for _name in _row.packages:
        PACKAGES[_name] = PACKAGES.get(_name, ()) + (_row.kind,)
PACKAGES.update({name: () for name in EVERY_JOB[1:] + FILE_INPUTS})
# Each launcher's own packages (the launcher table's ``packages``: Ray's, docs/ray.md): missing is a warning.
LAUNCHER_PACKAGES = {name: (row.name, requirement) for row in launchers.LAUNCHERS.values()
                     for name, requirement in row.packages}
PACKAGES.update({name: () for name in LAUNCHER_PACKAGES})
_PIN = re.compile(r"(?<![\w.-])([A-Za-z0-9][A-Za-z0-9_.-]*)(?:\[[\w,.-]*\])?==([0-9][0-9A-Za-z.+!-]*)")


@dataclass(frozen=True, slots=True)
class Check:
    """One row of the doctor's table."""

    name: str
    status: str  # pass | warn | fail | skip
    detail: str
    fix: str = ""


def pins(folder: Path = ENVIRONMENT) -> dict[str, str]:
    """Pinned versions (normalised package name -> version) from ``environment/requirements-*.txt`` and
    ``install.sh`` (torch and deepspeed are pinned there: they are installed apart); the first pin seen wins."""
    found: dict[str, str] = {}
    files = sorted(folder.glob("requirements-*.txt")) + [folder / "install.sh", folder / "install-horovod.sh"]
    for path in files:
        if not path.is_file():
            continue
        for name, version in _PIN.findall(path.read_text(encoding="utf-8", errors="replace")):
            found.setdefault(_norm(name), version)
    return found


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def python_check(minimum: tuple[int, int] | None = None) -> Check:
    minimum = minimum or _python_requires()
    have = sys.version_info[:3]
    text = ".".join(map(str, have))
    if have[:2] >= minimum:
        return Check("python", "pass", f"{text} ({sys.executable}; needs >= {minimum[0]}.{minimum[1]})")
    return Check("python", "fail", f"{text} is older than {minimum[0]}.{minimum[1]}",
                 f"use Python >= {minimum[0]}.{minimum[1]} (e.g. `module load python` or a newer venv)")


def _python_requires() -> tuple[int, int]:
    cfg = REPO / "setup.cfg"
    if cfg.is_file():
        m = re.search(r"python_requires\s*=\s*>=\s*(\d+)\.(\d+)", cfg.read_text())
    else:  # installed from a wheel: setup.cfg stayed behind; its python_requires is the metadata's Requires-Python
        try:
            m = re.search(r">=\s*(\d+)\.(\d+)", importlib.metadata.metadata("hpc_tools")["Requires-Python"] or "")
        except importlib.metadata.PackageNotFoundError:
            m = None
    return (int(m.group(1)), int(m.group(2))) if m else (3, 10)


def pins_check(folder: Path = ENVIRONMENT) -> list[Check]:
    """A row only where the pins are not beside the package: installed from a wheel, the checkout's environment/ is
    not there, and the package rows compare with nothing."""
    if any(folder.glob("requirements-*.txt")):
        return []
    return [Check("pins", "skip", f"no environment/ beside {REPO} (installed from a wheel, not a checkout): the "
                                  "package versions are not compared with the tested pins")]


def package_checks(backend: str | None = None, pinned: dict[str, str] | None = None,
                   data_source: str | None = None) -> list[Check]:
    """Each package against its pin: missing and needed (by every job, by ``backend``, or, for ``datasets``, by a
    recipe whose ``data_source`` is ``files``) = fail; missing and not needed = warn; a version other than the pin =
    warn (it may work; the pins are what the tests ran)."""
    pinned = pins() if pinned is None else pinned
    rows = []
    for name, kinds in PACKAGES.items():
        pin = pinned.get(_norm(name))
        install = f"pip install {name}=={pin}" if pin else f"pip install {name}"
        if name in ("torch", "deepspeed"):
            install = "bash environment/install.sh (it installs torch and deepspeed the right way)"
        if name == "horovod":
            install = f"{HOROVOD_INSTALL} (builds it once against this torch and caches the wheel)"
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            needed = not kinds or backend is None or backend in kinds
            why = "every job" if not kinds else f"backend.kind: {' or '.join(kinds)}"
            if name in FILE_INPUTS:
                needed, why = data_source == "files", FILE_INPUTS_WHY
            if name in LAUNCHER_PACKAGES:
                launcher, requirement = LAUNCHER_PACKAGES[name]
                needed, why, install = False, f"cluster.launcher: {launcher}", f"pip install '{requirement}=={pin}'"
            rows.append(Check(name, "fail" if needed else "warn", f"not installed (needed by {why})", install))
            continue
        if pin is None or have.split("+")[0] == pin:
            rows.append(Check(name, "pass", have + (f" (pinned {pin})" if pin else " (no pin found)")))
        else:
            rows.append(Check(name, "warn", f"{have}, pinned {pin}", install))
    return rows


def torch_checks(wants_gpus: bool | None) -> list[Check]:
    """torch's build, CUDA, the driver and NCCL (imports torch: seconds). ``wants_gpus``: the recipe's GPU type is
    not cpu (None: no recipe)."""
    try:
        import torch
    except ImportError:
        return [Check("cuda", "skip", "torch is not installed (see its row)")]
    cuda = torch.version.cuda
    if not cuda:
        if wants_gpus:
            return [Check("cuda", "fail", f"torch {torch.__version__} is a CPU build; the recipe asks for GPUs",
                          'install a CUDA build: HPC_TOOLS_TORCH="torch==<pin> --index-url <CUDA wheel index>" '
                          "bash environment/install.sh")]
        return [Check("cuda", "pass" if wants_gpus is False else "skip",
                      f"torch {torch.__version__} is a CPU build (CPU ranks only)")]
    rows = []
    if torch.cuda.is_available():
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        rows.append(Check("cuda", "pass", f"CUDA {cuda}, {torch.cuda.device_count()} GPU(s): {', '.join(names)}"))
    else:
        rows.append(Check("cuda", "warn" if wants_gpus else "skip",
                          f"torch built for CUDA {cuda}, but no GPU is visible here",
                          "fine on a login node; on a compute node check CUDA_VISIBLE_DEVICES and the driver"
                          if wants_gpus else ""))
    driver = _nvidia_driver()
    rows.append(Check("driver", "pass", driver) if driver else
                Check("driver", "warn" if wants_gpus else "skip", "nvidia-smi is not available here",
                      "fine on a login node; GPU nodes need the NVIDIA driver" if wants_gpus else ""))
    try:
        nccl = torch.cuda.nccl.version()
        rows.append(Check("nccl", "pass", ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)))
    except Exception as exc:  # noqa: BLE001 - any failure here means "no usable NCCL"
        rows.append(Check("nccl", "fail" if wants_gpus else "warn", f"NCCL not usable ({type(exc).__name__})",
                          "install a torch build with NCCL (the CUDA wheels ship it)"))
    return rows


def horovod_wheel_dir(version: str | None = None, torch_version: str | None = None, nccl: bool = False) -> Path:
    """Where ``environment/install-horovod.sh`` keeps the Horovod wheel it built for this Python and torch (and the
    log of a build that failed, ``build-failed.log``): ``$HPC_TOOLS_WHEEL_CACHE`` (default
    ``~/.cache/hpc_tools/wheels``) / ``horovod-<version>-py<XY>-torch<torch version>``, ``-nccl`` for a build with
    NCCL (a CUDA torch: a gloo-only wheel is never taken for it); the script asks this function."""
    version = version or pins().get("horovod", "unpinned")
    torch_version = torch_version or _installed("torch") or "none"
    root = os.environ.get("HPC_TOOLS_WHEEL_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache",
                                                           "hpc_tools", "wheels")
    return Path(root, f"horovod-{version}-py{sys.version_info[0]}{sys.version_info[1]}-torch{torch_version}"
                      + ("-nccl" if nccl else ""))


def horovod_check(backend: str | None, timeout_s: float = 120, gpus: bool | None = None) -> Check | None:
    """Whether ``import horovod.torch`` works with this torch (a fresh interpreter: a C extension built against
    another torch fails to load), and for a recipe on GPUs (``gpus``) whether it was built with NCCL
    (``nccl_built()``: else GPU tensors reduce through host memory over gloo); or why the build against this torch
    failed; None where Horovod is neither installed nor tried (its package row says so)."""
    uses = backend is not None and "horovod" in backends.backend(backend).packages  # the recipe's backend
    needed = backend is None or uses
    level = "fail" if uses else "warn"
    have, torch_version = _installed("horovod"), _installed("torch")
    failed = next((f for f in (horovod_wheel_dir(torch_version=torch_version, nccl=n) / "build-failed.log"
                               for n in (True, False)) if f.is_file()), None)
    if have is None:
        if failed is None:
            return None
        return Check("horovod.torch", level if needed else "warn",
                     f"the build of Horovod against torch {torch_version} failed (its log: {failed})",
                     "Horovod 0.28.1 is its last release and may not build against a newer torch: train with "
                     "backend.kind: fsdp and backend.fsdp.strategy: ddp, or pin the torch it built with")
    try:
        out = subprocess.run([sys.executable, "-c", "import horovod.torch as h; print(int(h.nccl_built()))"],
                             capture_output=True, text=True, timeout=timeout_s)
        error = (out.stderr.strip().splitlines() or ["exit status " + str(out.returncode)])[-1] if out.returncode \
            else ""
    except subprocess.TimeoutExpired:
        error = f"the import took over {timeout_s:.0f} s"
    if not error and gpus and uses and out.stdout.strip() != "1":
        return Check("horovod.torch", "fail", f"horovod {have} imports with torch {torch_version} but was built "
                     "without NCCL (nccl_built() is false): this GPU recipe's gradients would reduce through host "
                     "memory over gloo", f"{HOROVOD_INSTALL} on this CUDA torch, with nvcc on PATH (builds it with "
                     "HOROVOD_GPU_OPERATIONS=NCCL)")
    if not error:
        return Check("horovod.torch", "pass", f"horovod {have} imports with torch {torch_version}"
                     + (" (with NCCL)" if out.stdout.strip() == "1" else ""))
    return Check("horovod.torch", level, f"horovod {have} does not load with torch {torch_version} (built against "
                 f"another torch?): {error[:200]}",
                 f"{HOROVOD_INSTALL} (rebuilds it against this torch)")


def _installed(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _has_module(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def megatron_te_range() -> str | None:
    """The Transformer Engine versions the installed megatron-core accepts (its ``dev`` extra's requirement, from its
    metadata), e.g. ``<2.12.0,>=2.9.0a0``; None when megatron-core is not installed or names none."""
    from packaging.requirements import Requirement

    try:
        requires = importlib.metadata.requires("megatron-core") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for line in requires:
        req = Requirement(line)
        if _norm(req.name) == "transformer-engine" and str(req.specifier):
            return str(req.specifier)
    return None


def needs_transformer_engine(recipe: Recipe | None) -> bool:
    """A Megatron recipe on GPUs whose layers fail without TE: ``transformer_impl: transformer_engine`` (``auto`` runs
    the local layers there, with SDPA attention under ``use_flash_attention``). The rule of
    ``hpc_tools/train/megatron/layers.py`` ``layer_plan`` (the control plane does not import the trainers)."""
    if recipe is None or backends.of(recipe).layers != "megatron" or not recipe.cluster.uses_gpus:
        return False
    return recipe.backend.megatron.transformer_impl == "transformer_engine"


def attention_path(recipe: Recipe, te: bool) -> str:
    """The attention path a GPU rank of this Megatron recipe gets on this node (``te``: Transformer Engine imports):
    ``te-flash|te-fused`` (TE chooses at the first forward), ``sdpa``, or ``unfused`` (TE's or Megatron's). The rule of
    ``layers.layer_plan`` (``tests/unit/test_doctor_gpu.py`` holds the two together)."""
    mg = recipe.backend.megatron
    if mg.transformer_impl == "local" or not te:
        return "sdpa" if mg.use_flash_attention else "unfused"
    return "te-flash|te-fused" if mg.use_flash_attention and recipe.training.precision != "fp32" else "unfused"


def attention_check(recipe: Recipe | None, te: bool) -> Check | None:
    """The attention path this node gives the recipe's Megatron ranks (GPU: with TE or without; CPU ranks: the local
    layers, as on a GPU without TE); None for other recipes."""
    if recipe is None or backends.of(recipe).layers != "megatron":
        return None
    if not recipe.cluster.uses_gpus:
        path = attention_path(recipe, False)
        return Check("attention", "pass", f"{path}: CPU ranks, Megatron-core local layers" + (
            ", attention on torch's scaled_dot_product_attention (its CPU kernels)" if path == "sdpa" else ""))
    if needs_transformer_engine(recipe) and not te:
        return None  # the transformer-engine row fails already
    path = attention_path(recipe, te)
    layers = "Transformer Engine layers" if te and recipe.backend.megatron.transformer_impl != "local" else (
        "Megatron-core local layers")
    if path == "te-flash|te-fused":
        return Check("attention", "pass", f"{path}: {layers}, TE chooses flash or cuDNN fused attention")
    if path == "sdpa":
        return Check("attention", "warn", f"sdpa: {layers}, attention on torch's scaled_dot_product_attention; norms, "
                     "activation and cross-entropy unfused (planned slower than TE layers)",
                     "install transformer_engine for TE's fused layers" if not te else "")
    return Check("attention", "warn", f"unfused: {layers}, O(s^2) attention (the local layers measured 22.9 % MFU "
                 "on an H200: docs/gpu-path.md)", "set backend.megatron.use_flash_attention: true")


def te_install_fix(pinned: dict[str, str] | None = None) -> str:
    pin = (pins() if pinned is None else pinned).get("transformer-engine")
    return ('bash environment/install.sh with the CUDA torch (it builds TE; needs nvcc), or by hand: pip install '
            'setuptools wheel ninja "pybind11[global]" && pip install --no-build-isolation '
            '"transformer_engine[pytorch,core_cu12]' + (f"=={pin}" if pin else "") + '" '
            "(environment/requirements-gpu.txt)")


def gpu_library_checks(recipe: Recipe | None = None, pinned: dict[str, str] | None = None,
                       capability: tuple[int, int] | None = None) -> list[Check]:
    """Transformer Engine (against megatron-core's accepted versions), apex's fused weight-gradient kernel and
    flash-attn: what the Megatron GPU path can use here (docs/gpu-path.md). Missing ones fail only where the recipe
    cannot run without them; elsewhere they are skipped (GPU nodes only)."""
    from packaging.specifiers import SpecifierSet

    megatron_gpu = recipe is not None and backends.of(recipe).layers == "megatron" and recipe.cluster.uses_gpus
    rows = []
    te, accepted = _installed("transformer-engine", "transformer-engine-torch"), megatron_te_range()
    if te is None:
        needed = needs_transformer_engine(recipe)
        slower = megatron_gpu and not needed and recipe.backend.megatron.transformer_impl == "auto"
        rows.append(Check("transformer-engine", "fail" if needed else "warn" if slower else "skip",
                          "not installed" + (": the recipe's Megatron layers need it on GPUs (transformer_impl)"
                                             if needed else ": the GPU ranks run the local layers (slower)"
                                             if slower else " (GPU nodes only)"),
                          te_install_fix(pinned)))
    elif accepted and te.split("+")[0] not in SpecifierSet(accepted, prereleases=True):
        rows.append(Check("transformer-engine", "fail" if megatron_gpu else "warn",
                          f"{te}, but megatron-core accepts {accepted}", te_install_fix(pinned)))
    else:
        rows.append(Check("transformer-engine", "pass", te + (f" (megatron-core accepts {accepted})" if accepted
                                                                else "")))
    if _has_module("fused_weight_gradient_mlp_cuda"):
        rows.append(Check("apex", "pass", "fused_weight_gradient_mlp_cuda: gradient_accumulation_fusion on (and TE's "
                                          "weight-gradient fusion)"))
    else:
        rows.append(Check("apex", "warn" if megatron_gpu else "skip",
                          "no fused_weight_gradient_mlp_cuda: gradient_accumulation_fusion off, and with it TE's "
                          "weight-gradient fusion (an extra 16-bit gradient write and fp32 add per micro-batch)",
                          "optional: build apex with its CUDA extensions (--cuda_ext) in this environment"
                          if megatron_gpu else ""))
    rows.append(flash_attn_check(_installed("flash-attn"), capability))
    attention = attention_check(recipe, te is not None)
    if attention is not None:
        rows.append(attention)
    return rows


def flash_attn_check(flash: str | None, capability: tuple[int, int] | None = None) -> Check:
    """flash-attn against the versions Transformer Engine 2.11 uses (``te_support.flash_attn_range``: 2.1.1 to
    2.8.3, from 2.7.3 on Blackwell): outside them TE ignores it and runs cuDNN's fused attention (a warning: it runs,
    but not with the flash-attn installed for it)."""
    from hpc_tools.recipe.te_support import TE_VERSION, flash_attn_range, flash_attn_used

    low, high = flash_attn_range(capability)
    if not flash:
        return Check("flash-attn", "skip", "not installed: Transformer Engine uses cuDNN's fused attention instead "
                                           "(fine)")
    if flash_attn_used(flash, capability):
        return Check("flash-attn", "pass", f"{flash}: within Transformer Engine {TE_VERSION}'s {low} to {high}; TE "
                                           "may pick it (attention=auto)")
    return Check("flash-attn", "warn", f"{flash}: Transformer Engine {TE_VERSION} uses flash-attn {low} to {high} "
                 "only and ignores this one (it runs cuDNN's fused attention instead)",
                 f'pip install "flash-attn=={high}" --no-build-isolation, or uninstall flash-attn')


def te_import_check() -> Check | None:
    """Transformer Engine's torch extension imports with this torch on a GPU node (a TE built against another torch,
    or for another CUDA, fails here with an undefined symbol instead of at a rank's start). None where TE is not
    installed or no GPU is visible (its own row, and the cuda row, say so)."""
    if _installed("transformer-engine", "transformer-engine-torch") is None:
        return None
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure means the extension does not load with this torch
        text = str(exc).splitlines()[0][:200] if str(exc) else ""
        return Check("te import", "fail", f"transformer_engine.pytorch does not import with this torch "
                     f"({type(exc).__name__}: {text})", "rebuild it against this torch: " + te_install_fix())
    return Check("te import", "pass", "transformer_engine.pytorch imports with this torch")


def fp8_recipe_check(recipe: Recipe | None, capability: tuple[int, int] | None, cuda: str | None) -> Check | None:
    """A recipe's ``fp8_recipe: blockwise`` against this node: compute ``capability`` (None: no GPU visible here,
    the CUDA build alone is checked) and torch's CUDA version (``te_support.blockwise_refusal``, the rank's own
    start check). None for a recipe without block-scaled FP8."""
    from hpc_tools.recipe.te_support import BLOCKWISE_FIX, blockwise_refusal

    if recipe is None or recipe.training.fp8 is None or recipe.training.fp8_recipe != "blockwise":
        return None
    why = blockwise_refusal(capability, cuda)
    if why:
        return Check("fp8 blockwise", "fail", f"training.fp8_recipe=blockwise {why}", BLOCKWISE_FIX)
    seen = f"compute capability {capability[0]}.{capability[1]}, " if capability else ""
    return Check("fp8 blockwise", "pass", f"{seen}CUDA {cuda}: Transformer Engine's block-scaled FP8 GEMM runs")


def _gpu_capability() -> tuple[int, int] | None:
    """The visible GPU's compute capability (flash-attn's range is narrower on Blackwell), None without one."""
    try:
        import torch

        return tuple(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - no torch, or a CUDA build that cannot see a GPU: no capability
        return None


def _fp8_recipe_row(recipe: Recipe | None) -> Check | None:
    """``fp8_recipe_check`` with this node's torch (imported only for a blockwise recipe)."""
    if recipe is None or recipe.training.fp8 is None or recipe.training.fp8_recipe != "blockwise":
        return None
    try:
        import torch
    except ImportError:
        return None
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    return fp8_recipe_check(recipe, capability, torch.version.cuda)


def nvme_offload_check(recipe: Recipe) -> Check | None:
    """DeepSpeed's ``async_io`` op, built at first use, for ``offload_optimizer``/``offload_param: nvme``: it needs
    libaio's headers and library and a C compiler here (DeepSpeed's own test: ``AsyncIOBuilder.has_function``).
    None for other recipes. Imports DeepSpeed (seconds)."""
    if backends.of(recipe).sharding != "zero":  # NVMe offload is ZeRO's (backend.deepspeed)
        return None
    ds = recipe.backend.deepspeed
    if "nvme" not in (ds.offload_optimizer, ds.offload_param):
        return None
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        ok = bool(AsyncIOBuilder().has_function("io_submit", ("aio",)))
    except Exception as exc:  # noqa: BLE001 - DeepSpeed missing or broken: its own row says which
        return Check("nvme offload", "fail", f"DeepSpeed's async_io builder not usable ({type(exc).__name__})",
                     "install deepspeed (bash environment/install.sh)")
    if ok:
        return Check("nvme offload", "pass", "libaio found: DeepSpeed builds its async_io op at first use")
    return Check("nvme offload", "fail", "DeepSpeed's async_io op (NVMe offload, built at first use) needs libaio and "
                 "a C compiler, and libaio's io_submit does not link here",
                 "apt-get install libaio-dev (dnf: libaio-devel) on the nodes, or set CFLAGS/LDFLAGS to a libaio "
                 "build; or offload to cpu")


def _nvidia_driver() -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]
    return f"driver {lines[0].split(',')[0]}" if out.returncode == 0 and lines else None


def slurm_check(view=None) -> Check:
    """Slurm installed and answering (sinfo within 3 s); no Slurm at all is fine (jobs run locally)."""
    from hpc_tools.world import slurm_view

    view = view or slurm_view()
    if view.checked:
        return Check("slurm", "pass", view.summary().replace("checked against Slurm partitions", "answers; partitions"))
    if view.absent:
        return Check("slurm", "skip", f"{view.why}: submit runs jobs locally")
    conf = os.environ.get("SLURM_CONF")
    if conf and not Path(conf).is_file():
        fix = f"SLURM_CONF={conf} is not a file: unset it, or point it at the cluster's slurm.conf"
    else:
        fix = "check `scontrol ping` (the controller must be UP) and the munge service; ask the admins if it is down"
    return Check("slurm", "fail", view.why, fix)


def recipe_checks(recipe: Recipe, executor: str, view=None) -> list[Check]:
    """The recipe against this machine's files and, for a Slurm job, the live partition; its container runtime."""
    from hpc_tools.world import path_violations, slurm_view, slurm_violations

    rows = []
    paths = path_violations(recipe)
    rows += [Check("recipe files", "fail", _rule(v), v.fix) for v in paths] or [
        Check("recipe files", "pass", "every file and folder it names exists here")]
    if executor == "slurm":
        view = view or slurm_view()
        if view.checked:
            found = slurm_violations(recipe, view)
            part = view.find(recipe.cluster.partition)
            rows += [Check("partition", "fail", _rule(v), v.fix) for v in found] or [
                Check("partition", "pass", f"{part.name} has the nodes, GPUs, CPUs and time the job asks for")]
        else:
            rows.append(Check("partition", "skip", f"Slurm does not answer ({view.why})"))
    else:
        rows.append(Check("partition", "skip", "the job runs locally (no Slurm here)"))
    rows.append(container_check(recipe))
    return rows


def _rule(v) -> str:
    return str(v).rsplit(f" ({v.fix})", 1)[0]


def container_check(recipe: Recipe, which: Callable[[str], str | None] = shutil.which) -> Check:
    """The runtime the recipe's container needs: apptainer/singularity on PATH, or pyxis (srun --container-image)
    with enroot. Missing with environment modules set up = warn (a module may bring it), else fail."""
    container = recipe.cluster.setup.container
    if container is None:
        return Check("container", "skip", "the recipe runs no container")
    via_module = bool(recipe.cluster.setup.modules)
    level = "warn" if via_module else "fail"
    if container.kind == "apptainer":
        found = which("apptainer") or which("singularity")
        if found:
            return Check("container", "pass", f"apptainer: {found}")
        return Check("container", level, "neither apptainer nor singularity is on PATH",
                     "install apptainer, or load it in cluster.setup.modules (e.g. apptainer)")
    if not which("srun"):
        return Check("container", level, "pyxis needs srun, which is not on PATH", "run on a Slurm login node")
    from hpc_tools import slurm_client

    has_pyxis = "--container-image" in slurm_client.srun_help()
    if not has_pyxis:
        return Check("container", "fail", "srun has no --container-image option (the pyxis plugin is not loaded)",
                     "ask the admins for pyxis + enroot, or use container.kind: apptainer")
    enroot = which("enroot")
    return Check("container", "pass" if enroot else "warn", "pyxis: srun --container-image" +
                 (f", enroot {enroot}" if enroot else "; enroot is not on PATH here"),
                 "" if enroot else "fine if the compute nodes have enroot (pyxis runs it there)")


def runs_dir_check(root: str | None = None) -> Check:
    """The runs folder a submission would write into: creatable and writable (``submission.checked_runs_root``)."""
    from hpc_tools.errors import UserError
    from hpc_tools.submission import checked_runs_root

    try:
        path = checked_runs_root(root)
    except UserError as exc:
        return Check("runs folder", "fail", str(exc), "choose a writable --runs-dir or set HPC_TOOLS_RUNS_DIR")
    return Check("runs folder", "pass", f"{path} is writable" + ("" if path.exists() else " (will be created)"))


def run_doctor(recipe: Recipe | None = None, executor: str = "local", runs_dir: str | None = None,
               with_torch: bool = True) -> list[Check]:
    """Every check, in the table's order."""
    wants_gpus = None if recipe is None else recipe.cluster.uses_gpus
    backend = None if recipe is None else recipe.backend.kind
    rows = [python_check(), *pins_check(), *package_checks(backend, data_source=recipe and recipe.data.source)]
    if with_torch:
        rows += torch_checks(wants_gpus)
        rows += [row for row in [_fp8_recipe_row(recipe), te_import_check(),
                                 horovod_check(backend, gpus=wants_gpus)] if row]
    rows += gpu_library_checks(recipe, capability=_gpu_capability() if with_torch else None)
    if with_torch and recipe is not None:
        rows += [row for row in [nvme_offload_check(recipe)] if row]
    rows.append(slurm_check())
    if recipe is not None:
        rows += recipe_checks(recipe, executor)
    rows.append(runs_dir_check(runs_dir))
    return rows


def format_table(rows: list[Check]) -> str:
    """Plain columns (CHECK, STATUS, DETAIL), each fix on the line under its row."""
    width = max(len(r.name) for r in rows)
    lines = [f"{'CHECK':<{width}}  STATUS  DETAIL"]
    for r in rows:
        lines.append(f"{r.name:<{width}}  {r.status.upper():<6}  {r.detail}")
        if r.fix and r.status in ("fail", "warn"):
            lines.append(f"{'':<{width}}  {'':<6}  fix: {r.fix}")
    counts = {s: sum(r.status == s for r in rows) for s in STATUSES}
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items() if n))
    return "\n".join(lines)


def as_json(rows: list[Check]) -> dict:
    return {"ok": not any(r.status == "fail" for r in rows), "checks": [asdict(r) for r in rows]}
