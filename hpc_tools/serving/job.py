"""The serving job: a script that runs the server in the serving environment, started as a local process group or
as a Slurm job on a node of its own; the readiness wait; the run folder's serving record; stopping it.

Files, under ``<run>/serve/``: ``serve.sbatch`` (the script, for both executors; a run's model is its export of the
newest checkpoint under ``<run>/exports/``, shared with ``eval`` and ``quantize``), ``serve-<job id>.out`` /
``serve-local.out`` (its log), ``endpoint.json`` (written by the server once ``generate`` is ready) and ``error``
(the one line of a bad start). The manifest holds ``serve`` (engine, executor, job id or process group, state, model
folder, script, log) and ``endpoint`` ``{host, http_port, grpc_port}`` while the server runs (None once it stopped).

A Hugging Face folder given directly gets a run folder of its own (``kind: serve``) under the runs root, so that
``status``, ``generate`` and ``cancel`` name it like any run.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from hpc_tools.errors import UserError
from hpc_tools.registry import RunFolder, atomic_write, find_run, new_run_id, now_iso, runs_root
from hpc_tools.serving.triton_server import port_free  # the server's own check (standard library only)

SERVE_DIR = "serve"
ENV_VAR = "HPC_TOOLS_SERVE_ENV"
REPO = Path(__file__).resolve().parents[2]
SERVER = Path(__file__).with_name("triton_server.py")
INSTALL = "bash environment/install-serve.sh"
ENGINES = ("triton", "vllm")
LIVE = ("STARTING", "RUNNING")
GB = 1e9
OVERHEAD = 1.2  # the framework's own memory and activations on top of weights and KV cache
_TIME = re.compile(r"^(\d+):([0-5]\d)$")


@dataclass
class ServeOptions:
    engine: str = "triton"
    executor: str = "local"
    time: str = "1:00"
    http_port: int = 8000
    grpc_port: int = 8001
    partition: str | None = None
    gpus: int = 0
    mem_gb: float | None = None
    max_batch_size: int = 8
    ready_timeout_s: float = 600.0


def serve_python() -> Path:
    """The serving environment's interpreter ($HPC_TOOLS_SERVE_ENV, else <repo>/.venv-serve)."""
    env = Path(os.environ.get(ENV_VAR) or REPO / ".venv-serve")
    py = env / "bin" / "python"
    if not py.exists() or not (env / ".hpc_tools-serve-complete").is_file():
        raise UserError(f"the serving environment {env} is missing or incomplete (install it: {INSTALL}, "
                        f"or set {ENV_VAR} to one it made)")
    return py


def check_time(value: str) -> int:
    """--time H:MM -> minutes (a UserError for anything else)."""
    m = _TIME.match(value or "")
    if not m or int(m[1]) * 60 + int(m[2]) == 0:
        raise UserError(f"--time={value} is not a serving time limit H:MM above 0:00 (e.g. --time 2:00)")
    return int(m[1]) * 60 + int(m[2])


def check_engine(opts: ServeOptions) -> None:
    """vLLM's wheels are CUDA builds: --engine vllm only on a GPU node."""
    if opts.engine != "vllm":
        return
    if opts.executor == "slurm":
        if opts.gpus < 1:
            raise UserError("--engine vllm needs a GPU node (vLLM's wheels are CUDA builds): give --gpus N on a GPU "
                            "partition, or serve with --engine triton on CPU")
    elif not local_gpus():
        raise UserError("--engine vllm needs a GPU (vLLM's wheels are CUDA builds) and this machine has none "
                        "(nvidia-smi lists no GPU): serve with --engine triton on CPU")


VLLM_ENV = "HPC_TOOLS_VLLM_PYTHON"  # vLLM's interpreter: an environment of its own (vLLM pins its own torch)
VLLM_VENV = "HPC_TOOLS_VLLM_ENV"  # where environment/install-vllm.sh puts that environment (default <repo>/.venv-vllm)
VLLM_INSTALL = "bash environment/install-vllm.sh"


def vllm_python() -> str:
    """vLLM's interpreter: $HPC_TOOLS_VLLM_PYTHON, else the python of the environment install-vllm.sh completed
    ($HPC_TOOLS_VLLM_ENV, default <repo>/.venv-vllm), else ``python3`` (a container's own)."""
    if os.environ.get(VLLM_ENV):
        return os.environ[VLLM_ENV]
    env = Path(os.environ.get(VLLM_VENV) or REPO / ".venv-vllm")
    if (env / ".hpc_tools-vllm-complete").is_file() and (env / "bin" / "python").exists():
        return str(env / "bin" / "python")
    return "python3"
SERVE_CUDA_TORCH = 'HPC_TOOLS_SERVE_TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"'


def _ask_python(python: str | Path, code: str) -> tuple[int, str]:
    """(exit status, stdout) of ``python -c code``; (-1, why) when it does not run."""
    try:
        out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return -1, str(exc)
    return out.returncode, out.stdout.strip()


def check_gpus(opts: ServeOptions, python: Path) -> None:
    """--gpus with Triton needs a CUDA torch in the serving environment (the server loads the model on the GPU in
    bf16 when torch sees one); a CPU-only build (its version's ``+cpu`` tag) would leave the GPUs idle."""
    if opts.engine != "triton" or not opts.gpus:
        return
    code, version = _ask_python(python, "import importlib.metadata as m; print(m.version('torch'))")
    if code == 0 and version.endswith("+cpu"):
        raise UserError(f"--gpus {opts.gpus} with --engine triton: the serving environment's torch {version} is a "
                        f"CPU-only build, so the model would run on the CPU and the GPUs sit idle (install it with a "
                        f"CUDA torch: {SERVE_CUDA_TORCH} {INSTALL}, or leave --gpus out)")


def check_vllm(opts: ServeOptions, config: dict) -> None:
    """--engine vllm: its interpreter ($HPC_TOOLS_VLLM_PYTHON) imports vLLM, and the tensor-parallel size (--gpus)
    divides the attention heads (vLLM refuses it otherwise, after the job started)."""
    if opts.engine != "vllm":
        return
    python = vllm_python()
    code, said = _ask_python(python, "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)")
    if code != 0:
        raise UserError(f"--engine vllm: {python} cannot import vllm{'' if code == 1 else f' ({said})'} (install "
                        f"its environment on a GPU node: {VLLM_INSTALL}, or set {VLLM_ENV} to the python of one "
                        "with vLLM, e.g. its container's; not the training environment's: vLLM pins its own torch)")
    heads = config.get("num_attention_heads") or config.get("n_head")
    tp = max(opts.gpus, 1)
    if heads and heads % tp:
        fits = ", ".join(str(d) for d in range(1, min(heads, 8) + 1) if heads % d == 0)
        raise UserError(f"--gpus {opts.gpus}: vLLM's tensor-parallel size must divide the model's {heads} attention "
                        f"heads (give --gpus {fits})")


def local_gpu_bytes() -> list[float]:
    """Each local GPU's memory (nvidia-smi), empty without GPUs."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [float(x) * 2**20 for x in out.stdout.split() if x.replace(".", "", 1).isdigit()]


def local_gpus() -> int:
    if not shutil.which("nvidia-smi"):
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines()) if out.returncode == 0 else 0


def check_ports(opts: ServeOptions) -> None:
    """Locally, a fixed port already in use is refused before anything starts (on a Slurm node the server checks)."""
    if opts.http_port and opts.http_port == opts.grpc_port:
        raise UserError(f"--http-port and --grpc-port are both {opts.http_port} (give two ports, or 0 for any free)")
    if opts.executor != "local":
        return
    for flag, port in (("--http-port", opts.http_port), ("--grpc-port", opts.grpc_port)):
        if port and not port_free(port):
            raise UserError(f"{flag}={port} is in use on this machine (choose another port, or 0 for any free one)")


# -- what is served ---------------------------------------------------------------------------------------------------
def model_folder(ref: str) -> Path | None:
    """``ref`` as a Hugging Face model folder (it has a config.json and is no run folder), else None."""
    path = Path(ref)
    if (path / "config.json").is_file() and not (path / "manifest.json").is_file():
        return path.absolute()
    return None


def target(ref: str, runs_dir: str | None) -> tuple[RunFolder, Path | None]:
    """The run ``ref`` names and its model folder when it has one (a folder served before); None: export the run."""
    try:
        run = find_run(ref, runs_root(runs_dir))
    except UserError as exc:
        raise UserError(f"{ref} is neither a Hugging Face model folder (no config.json) nor a run: {exc}") from None
    manifest = run.manifest()
    if manifest.get("kind") == "serve":  # a folder served before: served again from its run folder
        return run, Path(manifest["model_dir"])
    return run, None


def serve_run(model_dir: Path, root: Path) -> RunFolder:
    """A run folder of its own (``kind: serve``) for a Hugging Face folder served directly."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", model_dir.absolute().name)[:40] or "model"
    run_id = new_run_id(f"serve-{name}")
    folder = root / run_id
    folder.mkdir(parents=True)
    atomic_write(folder / "manifest.json", json.dumps({"run_id": run_id, "kind": "serve", "created": now_iso(),
                                                       "model_dir": str(model_dir.absolute()), "events": []},
                                                      indent=2, sort_keys=True))
    return RunFolder(folder)


def run_weight_bytes(run: RunFolder) -> float:
    """The run's model in fp32 (what ``export`` writes) by the planner's parameter count."""
    from hpc_tools.hf.export import run_recipe
    from hpc_tools.planner.arch import arch_for, total_parameters

    return 4.0 * total_parameters(arch_for(run_recipe(run)))


def folder_weight_bytes(model_dir: Path) -> float:
    """Bytes of the tensors in a folder's safetensors files (their headers), else the files' sizes."""
    total = 0.0
    for f in sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin")):
        if f.suffix == ".safetensors":
            try:
                with open(f, "rb") as fh:
                    header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
                total += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items()
                             if k != "__metadata__")
                continue
            except (OSError, ValueError, KeyError, TypeError):
                pass
        total += f.stat().st_size
    return total


def kv_cache_bytes(config: dict, batch: int) -> float:
    """fp32 keys and values of ``batch`` sequences of the model's full context."""
    layers = config.get("num_hidden_layers") or config.get("n_layer") or 0
    heads = config.get("num_attention_heads") or config.get("n_head") or 1
    hidden = config.get("hidden_size") or config.get("n_embd") or 0
    kv_heads = config.get("num_key_value_heads") or heads
    context = config.get("max_position_embeddings") or config.get("n_positions") or 0
    return 2.0 * layers * kv_heads * (hidden // heads) * context * batch * 4


def node_memory_bytes(opts: ServeOptions) -> tuple[float | None, str]:
    """(memory of the node the server gets, where the figure comes from); None when unknown."""
    if opts.mem_gb is not None:
        return opts.mem_gb * GB, f"--mem {opts.mem_gb:g} GB"
    if opts.executor == "local":
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024.0, "this machine's available memory"
        except OSError:
            return None, ""
        return None, ""
    from hpc_tools import slurm_client

    sizes = slurm_client.node_memory_mb(opts.partition)
    return (max(sizes) * 1e6, "the largest node's memory (sinfo %m)") if sizes else (None, "")


def check_memory(weights: float, config: dict, opts: ServeOptions) -> None:
    if opts.engine == "vllm":
        check_vllm(opts, config)
        check_gpu_memory(weights, opts)
        return
    need = OVERHEAD * weights + kv_cache_bytes(config, opts.max_batch_size)
    have, source = node_memory_bytes(opts)
    if have is not None and need > have:
        raise UserError(f"the model needs about {need / GB:.3g} GB to serve ({weights / GB:.3g} GB of fp32 weights "
                        f"x {OVERHEAD} + the KV cache of {opts.max_batch_size} full-context sequences) and the node "
                        f"has {have / GB:.3g} GB ({source}): serve it on a node with more memory (--mem, "
                        "--partition), or quantize it first")


VLLM_MEMORY_SHARE = 0.9  # vLLM's default gpu_memory_utilization


def check_gpu_memory(weights: float, opts: ServeOptions) -> None:
    """vLLM: the weights in 16 bits (its dtype ``auto`` serves an fp32 export in fp16/bf16) within its share of the
    GPUs' memory, where it is known (the local executor's nvidia-smi; a Slurm node's is not known here)."""
    gpus = local_gpu_bytes() if opts.executor == "local" else []
    if not gpus:
        return
    have = VLLM_MEMORY_SHARE * sum(sorted(gpus, reverse=True)[:max(opts.gpus, 1)])
    if weights / 2 > have:
        raise UserError(f"the model's weights take about {weights / 2 / GB:.3g} GB in 16 bits and vLLM gets "
                        f"{have / GB:.3g} GB of {max(opts.gpus, 1)} GPU(s) ({VLLM_MEMORY_SHARE} of their memory): "
                        "give more --gpus, or quantize it first")


def hf_config(model_dir: Path) -> dict:
    try:
        return json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def export_for_serving(run: RunFolder) -> Path:
    """The run's newest verified checkpoint as a Hugging Face folder: the run's one export of it, which ``eval`` and
    ``quantize`` read too (``hf.export.shared_export``; written now unless it is there)."""
    import sys

    from hpc_tools.hf.export import checkpoint_root, run_recipe, shared_export, verified_checkpoint

    ckpt = verified_checkpoint(run, checkpoint_root(run_recipe(run), run), None)
    with contextlib.redirect_stdout(sys.stderr):
        return shared_export(run, ckpt)


# -- the script -------------------------------------------------------------------------------------------------------
def serve_cluster(run: RunFolder):
    """The cluster section the serving job takes its account, qos, partition, constraint, extra ``#SBATCH`` lines,
    set-up and container from: the run's recipe's; for a folder served directly (no recipe), the site file's
    ``cluster`` section (``recipe/site.py``), else the schema's defaults."""
    from hpc_tools.recipe.cluster import ClusterConfig

    if run.recipe_path.is_file():
        from hpc_tools.hf.export import run_recipe

        return run_recipe(run).cluster
    from hpc_tools.recipe.site import read_site

    return ClusterConfig.model_validate(read_site()[1].get("cluster") or {})


def server_lines(model_dir: Path, opts: ServeOptions, python: Path, folder: Path, prefix: list[str]) -> list[str]:
    """The program of the serving job (both executors): the server, under coreutils ``timeout`` locally (no Slurm
    time limit there); ``prefix``: the container's words before the interpreter."""
    minutes = check_time(opts.time)
    q = shlex.quote
    host = 'HOST="${HPC_TOOLS_SERVE_HOST:-$(hostname)}"'
    endpoint, error = q(str(folder / "endpoint.json")), q(str(folder / "error"))
    limit = '"${LIMIT[@]}"' + "".join(f" {q(w)}" for w in prefix)
    lines = ["set -u", "export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1", host,
             "LIMIT=()  # locally there is no Slurm time limit: coreutils timeout stands in for it",
             f'[ -n "${{SLURM_JOB_ID:-}}" ] || LIMIT=(timeout --kill-after=30 {minutes * 60})']
    if opts.engine == "triton":
        return lines + [f"exec {limit} {q(str(python))} {q(str(SERVER))} --model {q(str(model_dir))} "
                        f"--http-port {opts.http_port} --grpc-port {opts.grpc_port} --host \"$HOST\" "
                        f"--endpoint-file {endpoint} --error-file {error} --max-batch-size {opts.max_batch_size} "
                        f"--ready-timeout-s {opts.ready_timeout_s:.0f}"]
    port = opts.http_port or 8000  # vLLM's OpenAI-compatible server (HTTP only), in its own environment
    return lines + [f'{limit} {q(vllm_python())} -m vllm.entrypoints.openai.api_server '
                    f"--model {q(str(model_dir))} --host 0.0.0.0 --port {port} "
                    f"--tensor-parallel-size {max(opts.gpus, 1)} &",
                    "PID=$!",
                    f'until curl -sf "http://127.0.0.1:{port}/health" > /dev/null; do',
                    '    kill -0 "$PID" 2>/dev/null || { wait "$PID"; exit $?; }',
                    "    sleep 2",
                    "done",
                    f"printf '{{\"host\": \"%s\", \"http_port\": {port}, \"grpc_port\": null, \"engine\": "
                    f"\"vllm\", \"model\": \"%s\", \"pid\": %s}}' \"$HOST\" {q(str(model_dir))} \"$$\" "
                    f"> {endpoint}.tmp",
                    f"mv {endpoint}.tmp {endpoint}",
                    'wait "$PID"']


def render_script(run: RunFolder, model_dir: Path, opts: ServeOptions, python: Path, cluster=None) -> str:
    """The serving job's script (``render.batch.render_serve``: the cluster section's account, qos, partition,
    constraint, extra lines, set-up and container on a Slurm node of its own); the same file runs locally."""
    from hpc_tools.render.batch import render_serve, serve_container

    cluster = serve_cluster(run) if cluster is None else cluster
    slurm = opts.executor == "slurm"
    prefix = serve_container(cluster, str(REPO), str(run.path)) if slurm else []
    body = server_lines(model_dir, opts, python, run.path / SERVE_DIR, prefix)
    return render_serve(cluster, run.run_id, run.path, f"hpc_tools serve: {opts.engine} over {model_dir}", body,
                        check_time(opts.time), opts.partition, opts.gpus, opts.mem_gb, slurm)


# -- starting, waiting, recording ----------------------------------------------------------------------------------
def start(run: RunFolder, model_dir: Path, opts: ServeOptions, python: Path) -> dict:
    """Write the script, start the job, wait until the server is ready; returns the endpoint. A start that fails
    is stopped (nothing left running) and raised as one line."""
    folder = run.path / SERVE_DIR
    folder.mkdir(exist_ok=True)
    for stale in ("endpoint.json", "error"):
        (folder / stale).unlink(missing_ok=True)
    script = folder / "serve.sbatch"
    atomic_write(script, render_script(run, model_dir, opts, python))
    record = {"engine": opts.engine, "executor": opts.executor, "model_dir": str(model_dir), "script": str(script),
              "state": "STARTING", "submitted": now_iso(), "time": opts.time}
    if opts.executor == "local":
        log = folder / "serve-local.out"
        with open(log, "ab") as out:
            proc = subprocess.Popen(["bash", str(script)], stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    env={**os.environ, "HPC_TOOLS_SERVE_HOST": "127.0.0.1"})
        record.update(pid=proc.pid, log=str(log))
    else:
        from hpc_tools.executors.slurm import sbatch_script

        try:
            job_id = sbatch_script(script, {}, cwd=folder, what="the serving job",
                                   fix="fix the recipe's cluster section or --partition, --gpus, --mem")
        except UserError:
            script.unlink(missing_ok=True)  # nothing left behind by a job that never queued
            raise
        record.update(job_id=job_id, log=str(folder / f"serve-{job_id}.out"))
    run.update(event="serve submitted", serve=record, endpoint=None)
    try:
        endpoint = wait_ready(run, record, opts.ready_timeout_s)
    except BaseException:
        stop(run, "FAILED")
        raise
    record.update(state="RUNNING", ready=now_iso(), endpoint=endpoint)
    run.update(event="serving", serve=record, endpoint=public(endpoint))
    return endpoint


def public(endpoint: dict) -> dict:
    return {k: endpoint.get(k) for k in ("host", "http_port", "grpc_port")}


def wait_ready(run: RunFolder, record: dict, timeout_s: float) -> dict:
    folder = run.path / SERVE_DIR
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (folder / "error").is_file():
            raise UserError((folder / "error").read_text().strip().splitlines()[0])
        if (folder / "endpoint.json").is_file():
            endpoint = json.loads((folder / "endpoint.json").read_text())
            if answers(endpoint):
                return endpoint
        if not alive(record):
            time.sleep(0.5)  # the error file may land right after the exit
            if (folder / "error").is_file():
                raise UserError((folder / "error").read_text().strip().splitlines()[0])
            raise UserError(f"the serving job ended before the server was ready (see {record['log']})")
        time.sleep(0.5)
    raise UserError(f"the server was not ready within {timeout_s:.0f} s (see {record['log']}; a pending Slurm job "
                    "waits for a free node: --ready-timeout)")


def answers(endpoint: dict, timeout_s: float = 5.0) -> bool:
    """Whether the endpoint's HTTP port answers readiness (Triton: the generate model; vLLM: /health)."""
    import urllib.request

    path = "/health" if endpoint.get("engine") == "vllm" else f"/v2/models/{endpoint.get('model', 'generate')}/ready"
    try:
        with urllib.request.urlopen(f"http://{endpoint['host']}:{endpoint['http_port']}{path}",
                                    timeout=timeout_s) as r:
            return r.status == 200
    except OSError:
        return False


def alive(record: dict) -> bool:
    """Whether the serving job still runs (local: its process group; Slurm: squeue still lists the job)."""
    if record.get("executor") == "local":
        return group_alive(record.get("pid"))
    from hpc_tools import slurm_client

    state = slurm_client.job_state(str(record["job_id"]))
    if state is None:
        return True  # unknown: not declared dead
    return state not in ("", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")


def group_alive(pid) -> bool:
    if not pid:
        return False
    try:
        os.waitpid(int(pid), os.WNOHANG)  # reap our own child (a test that served in-process)
    except ChildProcessError:
        pass
    try:
        os.killpg(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def refresh(run: RunFolder) -> dict | None:
    """The run's serving record with its state read live: a server that is gone is recorded ENDED (endpoint None)."""
    manifest = run.manifest()
    record = manifest.get("serve")
    if not record or record.get("state") not in LIVE or alive(record):
        return record
    record = {**record, "state": "ENDED", "ended": now_iso()}
    run.update(event="serve ended", serve=record, endpoint=None, soft=True)
    return record


def stop(run: RunFolder, state: str = "CANCELLED", grace_s: float = 20.0) -> dict:
    """Stop the serving job and wait until it is gone (local: SIGTERM to its process group, SIGKILL after
    ``grace_s``; Slurm: scancel, then until squeue no longer lists it)."""
    record = dict(run.manifest().get("serve") or {})
    if record.get("executor") == "local" and record.get("pid"):
        pid = int(record["pid"])
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while group_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if group_alive(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while group_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.2)
    elif record.get("job_id"):
        from hpc_tools.executors.slurm import cancel

        cancel(str(record["job_id"]))  # one line (slurm_client.SlurmError) when Slurm does not take it
        deadline = time.monotonic() + 60
        while alive(record) and time.monotonic() < deadline:
            time.sleep(0.5)
    record.update(state=state, ended=now_iso())
    run.update(event=f"serve {state.lower()}", serve=record, endpoint=None, soft=True)
    return record

