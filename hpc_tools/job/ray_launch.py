"""``cluster.launcher: ray``: Ray Train starts the ranks; each runs the project's own rank program.

``python -m hpc_tools.job.ray_launch drive --run-dir RUN [--address HOST:PORT --nodes N | --num-cpus N]``: the
driver. It connects to a Ray cluster (the one the batch script started over the allocation, ``--address``) or starts
a one-node Ray on this machine (the local executor), writes the dashboard's address into the manifest, and runs Ray
Train's ``TorchTrainer`` with ``ScalingConfig(num_workers=world, or (fewest, world) when cluster.min_nodes makes the
run elastic)`` and ``RunConfig(failure_config=FailureConfig(max_failures=cluster.restarts), storage_path=RUN/ray)``.

The per-worker loop starts ``python -m hpc_tools.runtime.rank --run-dir RUN`` in a process of its own with the
environment the rank program reads (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR/PORT:
``hpc_tools.runtime.distenv``), so records, collectors, verified checkpoints and reports are the native launcher's.
A process, not a call: Ray Train runs the loop in a thread of its worker actor, where the rank program could not
install its stop-signal handlers (Python allows them in the main thread only), and the rank program makes its own
process group, so Ray's torch backend is given one that only publishes the rendezvous (``RendezvousOnly``: no
``init_process_group`` in the actor). A rank that exits non-zero fails its worker, and Ray Train restarts the worker
group while ``max_failures`` lasts; the rank program resumes from the newest verified checkpoint, as after an
in-job restart. Each start's number reaches the records as ``HPC_TOOLS_RESTART_BASE``.

``python -m hpc_tools.job.ray_launch exports`` and ``... node``: the batch script's Ray cluster (docs/ray.md): the
head's address and ports derived from the job id, then one task per node running ``ray start --block`` (the head on
the first node), whose logs are copied into ``RUN/ray/<node>/`` when the step ends.

Ray is imported by the functions that use it, never at import time: the control plane imports nothing of Ray
(tests/unit/test_ray_launch.py).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from hpc_tools.registry import RunFolder, now_iso
from hpc_tools.runtime.distenv import RESTART_BASE_ENV, STORE_FD_ENV, first_host, free_port, listening_socket

REPO = Path(__file__).resolve().parents[2]  # the checkout (or site-packages) that holds hpc_tools
GCS_PORT_BASE, DASHBOARD_PORT_BASE, PORT_SPAN = 41000, 51000, 8000
NODES_TIMEOUT_S = 180.0  # how long the driver waits for every node of the allocation to join
STOP_FILE = "stop"  # RUN/ray/stop: written when the driver ends; each node then stops Ray and copies its logs


def ray_temp_dir(job_id: str | None, node: str) -> str:
    """Ray's temporary folder on one node: short (its socket paths must stay under ~107 characters) and one per job
    and node (nodes of a test cluster may share /tmp)."""
    return f"/tmp/hpct-ray-{job_id or os.getpid()}-{node}"[:60]


def ray_ports(job_id: str | int | None) -> tuple[int, int]:
    """(GCS port, dashboard port) of a job's Ray head, derived from its job id so that jobs sharing a node differ."""
    if job_id is None:
        return free_port(), free_port()
    n = int(str(job_id).split("_")[0]) % PORT_SPAN
    return GCS_PORT_BASE + n, DASHBOARD_PORT_BASE + n


def exports(run_dir: str, env: dict[str, str] | None = None) -> str:
    """The batch script's Ray variables as shell exports: head node, GCS and dashboard ports, and Ray's token
    authentication with a token of this job's own (``RUN/ray/auth_token``, readable by its owner only), which every
    node, the driver and the workers read from the shared run folder."""
    import secrets

    env = dict(os.environ if env is None else env)
    gcs, dashboard = ray_ports(env.get("SLURM_JOB_ID"))
    head = first_host(env["SLURM_JOB_NODELIST"])
    token = RunFolder(run_dir).path / "ray" / "auth_token"
    token.parent.mkdir(parents=True, exist_ok=True)
    (token.parent / STOP_FILE).unlink(missing_ok=True)  # a requeued job's Ray runs again
    if not token.exists():
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return (f"export HPC_TOOLS_RAY_HEAD={shlex.quote(head)} HPC_TOOLS_RAY_PORT={gcs} "
            f"HPC_TOOLS_RAY_DASHBOARD_PORT={dashboard} RAY_AUTH_MODE=token "
            f"RAY_AUTH_TOKEN_PATH={shlex.quote(str(token))} RAY_USAGE_STATS_ENABLED=0")


# --- the driver ---------------------------------------------------------------------------------------------------


def _recipe(run: RunFolder):
    from hpc_tools.recipe.load import load_resolved

    return load_resolved(run.recipe_path)


def num_workers(cluster) -> int | tuple[int, int]:
    """Ray Train's ``num_workers``: the recipe's world, or (fewest, world) ranks when ``cluster.min_nodes`` makes the
    run elastic."""
    world = cluster.nodes * cluster.gpus_per_node
    return (cluster.fewest_nodes * cluster.gpus_per_node, world) if cluster.elastic else world


def drive(run_dir: str, address: str | None = None, nodes: int = 1, num_cpus: int | None = None) -> int:
    """Run the job's ranks under Ray Train; returns the exit code for the batch script (0: every rank completed)."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    run = RunFolder(run_dir)
    cluster = _recipe(run).cluster
    t0 = time.perf_counter()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # nothing leaves the machine
    env_vars = {"PYTHONPATH": os.pathsep.join(x for x in (str(REPO), os.environ.get("PYTHONPATH")) if x)}
    if address:
        host, _, port = address.rpartition(":")
        _wait_for_head(socket.gethostbyname(host), int(port))
        info = ray.init(address=address, runtime_env={"env_vars": env_vars}, log_to_driver=True)
        _wait_for_nodes(ray, nodes)
    else:
        info = ray.init(num_cpus=num_cpus or cluster.nodes * cluster.gpus_per_node * cluster.cpus_per_task,
                        _temp_dir=ray_temp_dir(None, "local"), include_dashboard=True, dashboard_port=free_port(),
                        runtime_env={"env_vars": env_vars}, log_to_driver=True)
    started_s = round(time.perf_counter() - t0, 3)
    dashboard = info.dashboard_url or None
    if address and not dashboard and os.environ.get("HPC_TOOLS_RAY_DASHBOARD_PORT"):  # the batch script's head
        dashboard = f"{socket.gethostbyname(address.rpartition(':')[0])}:{os.environ['HPC_TOOLS_RAY_DASHBOARD_PORT']}"
    run.update(event="ray started", launcher="ray", ray_dashboard=dashboard and f"http://{dashboard}",
               ray_start_s=started_s, ray_nodes=len([n for n in ray.nodes() if n.get("Alive")]))
    print(f"Ray {ray.__version__}: {len(ray.nodes())} node(s) in {started_s:.1f} s, dashboard "
          f"{dashboard or 'off'}; Ray Train starts {num_workers(cluster)} worker(s)", flush=True)
    base = int(os.environ.get(RESTART_BASE_ENV, "0") or 0)
    trainer = TorchTrainer(
        train_loop_per_worker=worker_loop,
        train_loop_config={"run_dir": str(run.path), "cwd": os.getcwd()},
        scaling_config=ScalingConfig(num_workers=num_workers(cluster), use_gpu=cluster.uses_gpus,
                                     resources_per_worker={"CPU": cluster.cpus_per_task,
                                                           **({"GPU": 1} if cluster.uses_gpus else {})}),
        run_config=RunConfig(name="train", storage_path=str(run.path / "ray"),
                             failure_config=FailureConfig(max_failures=cluster.restarts)),
        torch_config=rendezvous_only_config(str(run.path), base))
    code = 0
    try:
        trainer.fit()
    except Exception as exc:  # noqa: BLE001 - Ray Train's verdict: the restarts are spent; the ranks said why
        code = _failed_code(exc)
        print(f"Ray Train stopped: {type(exc).__name__}: {' '.join(str(exc).split())[:400]}", flush=True)
    finally:
        session = _session_dir(ray)
        ray.shutdown()
        if session and not address:  # a local Ray: its logs into the run folder (Slurm: each node copies its own)
            copy_logs(Path(session), run.path / "ray" / "local")
            shutil.rmtree(ray_temp_dir(None, "local"), ignore_errors=True)
    return code


def _wait_for_nodes(ray, nodes: int, timeout_s: float = NODES_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while (alive := len([n for n in ray.nodes() if n.get("Alive")])) < nodes:
        if time.monotonic() > deadline:
            raise SystemExit(f"Ray: {alive} of {nodes} nodes joined in {timeout_s:.0f} s (see RUN/ray/<node>/ and "
                             "the batch log)")
        time.sleep(1.0)


def _session_dir(ray) -> str | None:
    try:
        return ray.get_runtime_context().get_temp_dir() if hasattr(ray.get_runtime_context(), "get_temp_dir") \
            else None
    except Exception:  # noqa: BLE001 - the logs are a courtesy
        return None


def _failed_code(exc: BaseException) -> int:
    """The exit code of the first rank that failed, as the worker's error names it (``RankExited``), else 1."""
    text = str(exc)
    marker = "exited with code "
    if marker in text:
        tail = text.split(marker, 1)[1].split()[0].strip(".,;:)")
        if tail.lstrip("-").isdigit():
            code = int(tail)
            return 128 - code if code < 0 else code
    return 1


def copy_logs(session: Path, dest: Path) -> None:
    """Ray's session logs (``<temp>/session_latest/logs``, or that of ``session``) into the run folder."""
    src = session / "session_latest" / "logs"
    if not src.is_dir():
        src = session / "logs"
    if src.is_dir():
        shutil.copytree(src, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.sock", "sockets"))


# --- Ray Train's torch backend: the rendezvous only -----------------------------------------------------------------


def rendezvous_only_config(run_dir: str, restart_base: int):
    """A ``TorchConfig`` whose backend publishes MASTER_ADDR/PORT (worker 0's address, a free port there) and this
    start's number to every worker, and makes no process group: the rank program makes its own."""
    from dataclasses import dataclass

    from ray.train.backend import Backend
    from ray.train.torch import TorchConfig

    class RendezvousOnly(Backend):
        def __init__(self) -> None:
            self.starts = 0

        def on_start(self, worker_group, backend_config) -> None:
            start = backend_config.restart_base + self.starts
            if self.starts:  # Ray Train restarted the worker group (FailureConfig): recorded as an in-job restart
                record_restart(backend_config.run_dir, start)
            self.starts += 1
            addr, port = worker_group.execute_single(0, _address_and_port)
            worker_group.execute(_set_env, {"MASTER_ADDR": addr, "MASTER_PORT": str(port),
                                            RESTART_BASE_ENV: str(start)})

        def on_shutdown(self, worker_group, backend_config) -> None:
            pass

    @dataclass
    class RankProgramTorchConfig(TorchConfig):
        run_dir: str = ""
        restart_base: int = 0

        @property
        def backend_cls(self):
            return RendezvousOnly

    return RankProgramTorchConfig(run_dir=run_dir, restart_base=restart_base)


_HELD: list[socket.socket] = []  # worker 0's rendezvous socket, from its choice until its rank program has it


def _address_and_port() -> tuple[str, int]:
    """Worker 0's address and a port held listening there (every interface: the other nodes' ranks connect), which
    ``worker_loop`` hands to rank 0's program: no process of the node can take it in between."""
    import ray

    _release_held()
    _HELD.append(listening_socket(""))
    return ray.util.get_node_ip_address(), _HELD[0].getsockname()[1]


def _release_held() -> None:
    while _HELD:
        _HELD.pop().close()


def _set_env(values: dict[str, str]) -> None:
    os.environ.update(values)


def record_restart(run_dir: str, start: int) -> None:
    run = RunFolder(run_dir)
    manifest = run.manifest()
    entry = {"at": now_iso(), "restart": start, "kind": "ray", "cause": "a Ray Train worker failed",
             "reason": manifest.get("error") or manifest.get("reason"), "job_id": os.environ.get("SLURM_JOB_ID")}
    run.update(event="restarting", state="STARTING", restart_count=start,
               restarts=[*manifest.get("restarts", []), entry], reason=None, failed_ranks=None, failed_nodes=None,
               exit_code=None, error=None)
    print(f"Ray Train restarts the worker group (start {start}); the ranks resume from the newest verified "
          "checkpoint", flush=True)


# --- the per-worker loop -------------------------------------------------------------------------------------------


class RankExited(RuntimeError):
    """The rank program of this worker exited non-zero: Ray Train counts it as a worker failure."""


def rank_environment(context, base: dict[str, str]) -> dict[str, str]:
    """The rank program's environment from Ray Train's worker context (``hpc_tools.runtime.distenv`` reads it)."""
    env = dict(base)
    env.update({"RANK": str(context.get_world_rank()), "WORLD_SIZE": str(context.get_world_size()),
                "LOCAL_RANK": str(context.get_local_rank()), "LOCAL_WORLD_SIZE": str(context.get_local_world_size()),
                "NODE_RANK": str(context.get_node_rank()), "PYTHONUNBUFFERED": "1",
                "OMP_NUM_THREADS": base.get("OMP_NUM_THREADS", "1"),
                "HPC_TOOLS_EXECUTOR": base.get("HPC_TOOLS_EXECUTOR") or ("slurm" if "SLURM_JOB_ID" in base
                                                                          else "local")})
    for key in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_STEP_ID", "SLURM_STEP_NODELIST"):
        env.pop(key, None)  # the node's `ray start` task: not this rank's
    return env


def worker_loop(config: dict) -> None:
    """Ray Train's per-worker loop: this worker's rank program, to its end; its output to ``logs/rank<R>.out`` and,
    for rank 0, to Ray's worker log (which Ray forwards to the driver's console)."""
    import ray.train

    context = ray.train.get_context()
    run = RunFolder(config["run_dir"])
    env = rank_environment(context, dict(os.environ))
    rank = int(env["RANK"])
    held = _HELD[0] if rank == 0 and _HELD else None  # this actor is worker 0: it chose the port
    if held is not None:
        env[STORE_FD_ENV] = str(held.fileno())
    with open(run.logs_dir / f"rank{rank:05d}.out", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "hpc_tools.runtime.rank", "--run-dir", str(run.path)],
                                env=env, cwd=config.get("cwd"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                preexec_fn=_die_with_parent, pass_fds=(held.fileno(),) if held else ())
        _release_held()  # the rank program holds it now
        sinks = [log] + ([sys.stdout.buffer] if rank == 0 else [])
        pump = threading.Thread(target=_pump, args=(proc.stdout, sinks), daemon=True)
        pump.start()
        code = proc.wait()
        pump.join(timeout=5)
    if code:
        raise RankExited(f"rank {rank} exited with code {code}")


def _pump(src, sinks) -> None:
    for line in iter(src.readline, b""):
        for sink in sinks:
            sink.write(line)
            sink.flush()


def _die_with_parent() -> None:
    """In the rank's process, before exec: SIGKILL when the thread that started it ends (Ray ends a failed worker
    group's actors; their ranks must not outlive them)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


# --- one node of the batch script's Ray cluster -------------------------------------------------------------------


def node(run_dir: str, cpus: int | None, gpus: int | None) -> int:
    """One Slurm task per node: ``ray start --block`` (the head on the first node) until the driver has ended
    (``RUN/ray/stop``, which the batch script writes) or the step is ended; then this node's Ray logs into
    ``RUN/ray/<node>/``."""
    env = dict(os.environ)
    host = env.get("SLURMD_NODENAME") or socket.gethostname()
    gcs, dashboard = ray_ports(env.get("SLURM_JOB_ID"))
    head = env.get("HPC_TOOLS_RAY_HEAD") or first_host(env["SLURM_JOB_NODELIST"])
    temp = ray_temp_dir(env.get("SLURM_JOB_ID"), host)
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", f"--temp-dir={temp}"]
    cmd += [f"--num-cpus={cpus}"] if cpus else []
    cmd += [f"--num-gpus={gpus}"] if gpus is not None else []
    if host == head:
        cmd += ["--head", f"--port={gcs}", "--dashboard-host=0.0.0.0", f"--dashboard-port={dashboard}",
                "--include-dashboard=true"]
    else:
        head_ip = socket.gethostbyname(head)
        _wait_for_head(head_ip, gcs)
        cmd += [f"--address={head_ip}:{gcs}"]
    proc = subprocess.Popen(cmd, env={**env, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": os.pathsep.join(
        x for x in (str(REPO), env.get("PYTHONPATH")) if x)}, start_new_session=True)

    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    stop_file = RunFolder(run_dir).path / "ray" / STOP_FILE
    while proc.poll() is None and not stopping.is_set() and not stop_file.exists():
        time.sleep(1.0)
    if proc.poll() is None:  # the driver is done (or the step is ended): Ray's processes on this node end
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)  # Ray drains up to 30 s; its logs are written by then
        except subprocess.TimeoutExpired:
            proc.kill()
    code = proc.wait()
    asked = stopping.is_set() or stop_file.exists()
    with contextlib.suppress(ProcessLookupError, PermissionError):  # Ray's agents outlive `ray start` otherwise
        os.killpg(proc.pid, signal.SIGKILL)
    copy_logs(Path(temp), RunFolder(run_dir).path / "ray" / host)
    shutil.rmtree(temp, ignore_errors=True)
    return 0 if asked or code == 0 else code


def _wait_for_head(host: str, port: int, timeout_s: float = NODES_TIMEOUT_S) -> None:
    """Until the Ray head's GCS answers on ``host:port``; after ``timeout_s`` one line and exit 1 (``ray.init`` and
    ``ray start --address`` would retry for ever: the head's step may have failed to start)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            s.settimeout(1.0)
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(1.0)
    raise SystemExit(f"Ray: the head's GCS at {host}:{port} did not answer in {timeout_s:.0f} s (its node step may "
                     "have failed: see the batch log's srun lines and RUN/ray/<node>/)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_tools.job.ray_launch", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("drive", help="run the job's ranks under Ray Train")
    d.add_argument("--run-dir", required=True)
    d.add_argument("--address", help="HOST:PORT of a running Ray cluster (default: start a one-node Ray here)")
    d.add_argument("--nodes", type=int, default=1, help="nodes to wait for in that cluster")
    d.add_argument("--num-cpus", type=int, help="CPUs of the one-node Ray (default: one per rank)")
    e = sub.add_parser("exports", help="the batch script's Ray variables (head, ports, token) as shell exports")
    e.add_argument("--run-dir", required=True)
    n = sub.add_parser("node", help="one node of the batch script's Ray cluster (ray start --block)")
    n.add_argument("--run-dir", required=True)
    n.add_argument("--num-cpus", type=int)
    n.add_argument("--num-gpus", type=int)
    args = parser.parse_args(argv)
    if args.command == "exports":
        if "SLURM_JOB_NODELIST" not in os.environ:
            print("error: `ray_launch exports` runs inside a Slurm job (SLURM_JOB_NODELIST is not set)",
                  file=sys.stderr)
            return 2
        print(exports(args.run_dir))
        return 0
    if args.command == "node":
        return node(args.run_dir, args.num_cpus, args.num_gpus)
    return drive(args.run_dir, args.address, args.nodes, args.num_cpus)


if __name__ == "__main__":
    sys.exit(main())
