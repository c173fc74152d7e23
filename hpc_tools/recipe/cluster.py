"""``cluster:`` — where the job runs and how its environment is set up."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from hpc_tools.recipe.base import Section

# Slurm's --time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S.
# Every pattern here is used with fullmatch: `re.match(...$)` accepts a trailing newline, which ends a #SBATCH line.
TIME_LIMIT_RE = re.compile(r"(\d{1,5}-)?\d{1,7}(:\d{1,2}){0,2}")
ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,255}")
# Values that end up on #SBATCH lines, which sbatch parses itself (no shell quoting there): allow only what Slurm
# names can hold, so no value can smuggle in a second option or a new line.
SLURM_NAME_RE = re.compile(r"[A-Za-z0-9_.,:+-]{1,256}")
SLURM_CONSTRAINT_RE = re.compile(r"[A-Za-z0-9_.,:&|*\[\]()!-]{1,1024}")
# An extra #SBATCH directive: `--flag` or `--flag=value`, from a charset that cannot start a second option or line.
SBATCH_EXTRA_RE = re.compile(r"--([a-z][a-z0-9-]{0,63})(=[A-Za-z0-9_.,:+@%/=*-]{1,512})?")
RUN_DIR_MODE_RE = re.compile(r"0?7[0-7]{2}")  # the owner keeps rwx: the job writes its own run folder


def time_limit_minutes(value: str) -> float:
    """Minutes in a Slurm time limit string (the formats Slurm's --time accepts)."""
    days = 0
    if "-" in value:
        d, value = value.split("-", 1)
        days = int(d)
        parts = [int(x) for x in value.split(":")]
        hours, minutes, seconds = (parts + [0, 0])[:3]
    else:
        parts = [int(x) for x in value.split(":")]
        if len(parts) == 1:
            hours, minutes, seconds = 0, parts[0], 0
        elif len(parts) == 2:
            hours, minutes, seconds = 0, parts[0], parts[1]
        else:
            hours, minutes, seconds = parts
    return days * 1440 + hours * 60 + minutes + seconds / 60


# Every sbatch flag hpc_tools sets (``render.slurm_params.SlurmSpec.sbatch_options`` and the output lines), or that
# would contradict what it sets, with the way to change it instead: ``cluster.sbatch_extra`` may add any other
# directive. Stated here, beside the fields that set these flags, so the section's validator needs nothing above it.
OWNED_FLAGS = {
    "job-name": "it is the recipe's name", "nodes": "set cluster.nodes",
    "ntasks-per-node": "set cluster.gpus_per_node (one rank per GPU)", "ntasks": "set cluster.nodes and "
    "cluster.gpus_per_node (one rank per GPU)", "gpus-per-node": "set cluster.gpus_per_node",
    "gpus": "set cluster.gpus_per_node", "gres": "set cluster.gpus_per_node (sbatch gets --gpus-per-node)",
    "cpus-per-task": "set cluster.cpus_per_task", "mem": "set cluster.mem_gb",
    "mem-per-cpu": "set cluster.mem_gb", "mem-per-gpu": "set cluster.mem_gb", "time": "set cluster.time_limit",
    "partition": "set cluster.partition", "account": "set cluster.account", "qos": "set cluster.qos",
    "constraint": "set cluster.constraint", "reservation": "set cluster.reservation",
    "exclusive": "set cluster.exclusive", "signal": "set cluster.signal_delay_s", "requeue": "set cluster.requeue",
    "no-requeue": "set cluster.requeue", "open-mode": "a requeued job appends to its log",
    "output": "the log's place is fixed (logs read it there)", "error": "the log's place is fixed (logs read it there)",
    "chdir": "the run folder is fixed (set --runs-dir or HPC_TOOLS_RUNS_DIR)",
    "export": "the job needs the variables `submit` passes (set cluster.setup.env for more)",
    "array": "use a recipe's sweep: section", "no-kill": "set cluster.spare_nodes (a job with spares keeps running "
    "when a node fails)", "wrap": "the script is the job",
    "switches": "set cluster.switches",
}


def sbatch_flag_owner(flag: str) -> str | None:
    """How to set ``--flag`` when hpc_tools owns it (the fix to name), else None."""
    return OWNED_FLAGS.get(flag)

class ContainerConfig(Section):
    kind: Literal["apptainer", "pyxis"]
    """`apptainer` (apptainer exec --nv IMAGE) or `pyxis` (srun --container-image=IMAGE)."""
    image: str
    """Image path or URI."""
    mounts: list[str] = Field(default_factory=list)
    """Bind mounts, `src:dst` each."""


class EnvironmentSetup(Section):
    modules: list[str] = Field(default_factory=list)
    """Environment modules to `module load`, in order."""
    conda_env: str | None = None
    """Conda environment to activate (name or prefix)."""
    venv: str | None = None
    """Python virtual environment folder to activate."""
    container: ContainerConfig | None = None
    """Run every rank inside this container."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables exported before launch (values are taken literally, never expanded)."""

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if not ENV_NAME_RE.fullmatch(name):
                raise ValueError(f"has the invalid variable name {name!r} -- use letters, digits and _ "
                                 "(not starting with a digit)")
        return value


class ClusterConfig(Section):
    nodes: int = Field(default=1, gt=0, le=1 << 20)
    """Nodes to allocate."""
    gpus_per_node: int = Field(default=8, gt=0, le=1 << 12)
    """GPUs used per node; one rank runs per GPU (with gpu_type: cpu, CPU ranks per node)."""
    gpu_type: str = "H100-SXM"
    """GPU model (a key of the hardware table, e.g. A100-80GB, H100-SXM, H200, B200, MI300X) or `cpu` for CPU ranks."""
    gpu_mem_gb: float | None = Field(default=None, gt=0)
    """Override the GPU memory in the hardware table."""
    memory_headroom_gb: float | None = Field(default=None, ge=0)
    """GPU memory (GB) the fit check and the layout search keep free beyond the planned terms, for allocator
    fragmentation and NCCL buffers the plan does not model; null = 5 % of the GPU memory + 1 GB (docs/formulas.md)."""
    gpu_peak_tflops: float | None = Field(default=None, gt=0)
    """Override the dense peak TFLOP/s per GPU at the training precision (used for MFU and planning)."""
    intra_node_bw_gbps: float | None = Field(default=None, gt=0)
    """Override the intra-node (NVLink) bus bandwidth per GPU in GB/s."""
    inter_node_bw_gbps: float | None = Field(default=None, gt=0)
    """Override the inter-node network bandwidth per GPU in GB/s."""
    cpus_per_task: int = Field(default=8, gt=0, le=1 << 16)
    """CPU cores per rank (data loading threads)."""
    mem_gb: int | None = Field(default=None, gt=0, le=1 << 24)
    """Host memory per node in GB; null = the partition's default."""
    partition: str | None = None
    """Slurm partition."""
    account: str | None = None
    """Slurm account to charge."""
    qos: str | None = None
    """Slurm quality of service."""
    constraint: str | None = None
    """Slurm node feature constraint."""
    reservation: str | None = None
    """Slurm reservation."""
    exclusive: bool = False
    """Whole nodes for this job."""
    time_limit: str = "01:00:00"
    """Wall-clock limit in Slurm's --time format (e.g. 30, 04:00:00, 1-12:00:00)."""
    signal_delay_s: int = Field(default=120, ge=0, le=1 << 24)
    """Seconds before the time limit at which Slurm sends SIGUSR2, so the job checkpoints and requeues itself."""
    requeue: bool = True
    """Requeue on preemption, node failure and after a time-limit checkpoint."""
    restarts: int = Field(default=0, ge=0, le=1000)
    """In-job restarts over the run: when a rank dies or hangs (or its node crashes), the Slurm job ends that step and
    starts a new srun step in the same allocation from the newest complete checkpoint, without going back through the
    queue; each is recorded in the manifest's `restarts`. When the allocation cannot hold the layout (a node lost
    and no spare left) the job is requeued instead (with `requeue: true`). 0 = off: a failed rank ends the job."""
    spare_nodes: int = Field(default=0, ge=0, le=1 << 16)
    """Extra nodes allocated beside `nodes` (the layout still uses `nodes`): an in-job restart leaves a failed node
    out and takes a spare. Needs `restarts` > 0; the job is submitted with --no-kill, so that Slurm keeps it running
    when a node fails."""
    min_nodes: int | None = Field(default=None, gt=0, le=1 << 20)
    """Elastic training: the fewest nodes the run may continue on. When a node is lost and no spare answers, the
    in-job restart continues on the nodes that remain (at least `min_nodes`) with the layout the planner picks for
    them, keeping the global batch (more gradient accumulation), the model and the data order, from the newest
    checkpoint resharded into it; a later restart or requeue with the nodes back regrows to the recipe's layout
    (docs/elastic.md). Needs `restarts` > 0; the job is submitted with --no-kill. null = `nodes` (off)."""
    launcher: Literal["srun", "ray"] = "srun"
    """What starts the ranks: `srun` (one task per GPU, the default) or `ray` (a Ray cluster over the allocation
    drives the training loop as Ray Train's per-worker loop; the PyTorch-native backends; docs/ray.md)."""
    hang_timeout_min: float | None = Field(default=None, ge=0.0)
    """The hang watchdog's timeout: when a phase (the first step of a start, a training step, a checkpoint save, an
    evaluation) makes no progress for its bound, the job aborts with stack traces, naming the rank that stopped in
    HANG.txt and the manifest (with the detection time). null (the default) = calibrated per phase from the run's
    own observed maxima x 5, with floors (a step: max(60 s, 5 x the slowest observed step) after a 5-step warm-up;
    a save 300 s, an evaluation 120 s, the first step 10 minutes), carried across restarts and requeues in the run
    folder, each at most 30 minutes (10 minutes more before the first step); a number = that fixed timeout for
    every phase (a float: 0.25 = 15 s; 10 minutes more before the first step of a start), an explicit override;
    0 = off. The process group's own timeout is set 5 minutes longer than the cap, so this watchdog fires before
    NCCL's or gloo's abort (docs/failure-recording.md)."""
    switches: int | None = Field(default=None, gt=0, le=1 << 16)
    """Most leaf switches the job may span (sbatch --switches; Slurm's topology/tree plugin): Slurm keeps the job
    pending until it finds such an allocation, or the site's max_switch_wait passes (then it starts anyway); null = no
    request. `validate --topology FILE` (or the live `scontrol show topology`) says how many keep the TP, CP and EP
    groups each inside one leaf switch (docs/topology.md)."""
    switch_wait_min: int | None = Field(default=None, gt=0, le=1 << 20)
    """Most minutes the job may wait for its `switches` (the @max-time of sbatch --switches); null = the site's
    max_switch_wait (SchedulerParameters). Needs `switches`."""
    place_by_topology: bool = False
    """Order the ranks by the network topology before each rank step: the batch script reads `scontrol show
    topology` (tree or block plugin) and gives srun the step's nodes leaf switch by leaf switch (arbitrary
    distribution), so that consecutive ranks (TP, then CP and EP groups) share a node, then a leaf switch; without a
    topology the ranks keep Slurm's order. The rendered sbatch script only (not submitit)."""
    preflight: Literal["auto", "off", "strict"] = "auto"
    """Check the allocation on every rank before step 1 (docs/preflight.md): a GEMM at the training precision and a
    memory copy per rank, collectives at the layout's message size as bus bandwidth, a search for a slow link, and
    the transport each node uses; a per-node table goes into the run folder (preflight.json). A named node is left
    out when a spare node (`spare_nodes`) or a requeue without it can replace it (needs `restarts` > 0); otherwise
    `strict` fails the job naming the node, the figure and the reason, and `auto` (the default, multi-node jobs only)
    says so in one line and trains on; `off` skips it."""
    preflight_budget_s: int = Field(default=60, gt=0, le=3600)
    """Seconds preflight may take (its time slices are shares of it); a run over it is named as a problem. The time
    shows as the goodput report's `preflight` bucket."""
    python: str = "python3"
    """Python interpreter on the compute nodes."""
    sbatch_extra: list[str] = Field(default_factory=list, max_length=64)
    """Extra `#SBATCH` directives the schema lacks, `--flag` or `--flag=value` each (e.g.
    `--gres-flags=enforce-binding`, `--mail-type=END`); flags the schema owns are refused, naming the
    field to set instead."""
    run_dir_mode: str = "0755"
    """Permissions of run folders, in octal (0755 = group and others may read; 0750 = the group only; 0700 = you only);
    files in them get the same bits without execute (0644). The user's umask still applies."""
    setup: EnvironmentSetup = Field(default_factory=EnvironmentSetup)
    """Environment set-up run before launching ranks."""

    @field_validator("partition", "account", "qos", "reservation")
    @classmethod
    def _slurm_name(cls, value: str | None) -> str | None:
        if value is not None and not SLURM_NAME_RE.fullmatch(value):
            raise ValueError("is not a valid Slurm name -- use letters, digits and _ . , : + - only")
        return value

    @field_validator("constraint")
    @classmethod
    def _constraint(cls, value: str | None) -> str | None:
        if value is not None and not SLURM_CONSTRAINT_RE.fullmatch(value):
            raise ValueError("is not a valid Slurm constraint -- use feature names joined by & | , with [ ] ( ) * :")
        return value

    @field_validator("sbatch_extra")
    @classmethod
    def _sbatch_extra(cls, value: list[str]) -> list[str]:
        for item in value:
            m = SBATCH_EXTRA_RE.fullmatch(item)
            if not m:
                raise ValueError(f"holds {item[:80]!r}, not an #SBATCH directive -- write --flag or --flag=value "
                                 "(letters, digits and _ . , : + @ % / = * - only; no spaces)")
            owner = sbatch_flag_owner(m.group(1))
            if owner:
                raise ValueError(f"holds --{m.group(1)}, which hpc_tools sets itself -- {owner}")
        return value

    @field_validator("run_dir_mode", mode="before")
    @classmethod
    def _mode_text(cls, value):
        # YAML reads `run_dir_mode: 0750` as the octal integer 488 and `750` as decimal 750: take the digits as written
        if isinstance(value, int) and not isinstance(value, bool):
            text = oct(value)[2:] if value < 0o1000 and f"{value:o}" != str(value) else str(value)
            if not RUN_DIR_MODE_RE.fullmatch(text):
                raise ValueError(f"is {text.zfill(4)} in octal, not a folder mode the job can write -- use octal "
                                 "digits with the owner's 7, e.g. 0755, 0750 or 0700")
            return text
        return value

    @field_validator("run_dir_mode")
    @classmethod
    def _run_dir_mode(cls, value: str) -> str:
        if not RUN_DIR_MODE_RE.fullmatch(value):
            raise ValueError("is not a folder mode the job can write -- use octal digits with the owner's 7, "
                             "e.g. 0755, 0750 or 0700")
        return value.zfill(4)

    @property
    def run_dir_mode_bits(self) -> int:
        """``run_dir_mode`` as permission bits (e.g. 0o755)."""
        return int(self.run_dir_mode, 8)

    @field_validator("time_limit", mode="before")
    @classmethod
    def _time_limit_minutes(cls, value):
        # YAML reads `time_limit: 30` as an integer; Slurm reads it as minutes.
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("time_limit")
    @classmethod
    def _time_limit(cls, value: str) -> str:
        if not TIME_LIMIT_RE.fullmatch(value):
            raise ValueError("is not in Slurm's --time format -- use MM, HH:MM:SS or D-HH:MM:SS, e.g. 04:00:00")
        return value

    @property
    def time_limit_min(self) -> float:
        return time_limit_minutes(self.time_limit)

    @property
    def fewest_nodes(self) -> int:
        """The fewest nodes the run may continue on (`min_nodes`, else `nodes`: not elastic)."""
        return min(self.nodes, self.min_nodes) if self.min_nodes is not None else self.nodes

    @property
    def elastic(self) -> bool:
        """Whether an in-job restart may continue on fewer nodes than `nodes` (`min_nodes` below it, and `restarts`
        to restart with)."""
        return self.fewest_nodes < self.nodes and self.restarts > 0

    @property
    def uses_gpus(self) -> bool:
        return self.gpu_type.lower() != "cpu"
