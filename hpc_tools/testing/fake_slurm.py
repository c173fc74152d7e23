"""A stateful fake of Slurm's client commands for the fast test tier: ``sbatch`` hands out job ids, ``sacct`` answers
with the states the test sets, ``scancel`` cancels; nothing ever runs.

It is what submitit's own tests do with ``MockedSubprocess``, one level lower: the fake is a folder of executables
(``sbatch``, ``sacct``, ``squeue``, ``scancel``, ``scontrol``, ``sinfo``; ``srun``, which submitit looks for
before it submits, refuses every step) put first on PATH, so every caller --
``hpc_tools``' own subprocess calls, submitit's, a CLI started in a child process -- goes the path it goes on a
cluster, down to parsing what the commands print. Their state is one JSON file, locked per call (twenty concurrent
``submit``\\ s get twenty ids)::

    fake = FakeSlurm(tmp_path / "slurm")
    monkeypatch.setenv("PATH", fake.path)            # or run_cli(..., env=fake.env())
    job = submit(...)                                 # sbatch -> "1"
    fake.set_state("1", "TIMEOUT", elapsed="00:01:04")
    fake.calls("scancel")                             # [["scancel", "1"], ...]

Only what the toolkit and submitit ask is answered; anything else exits 2 naming itself, so a new caller fails loudly
instead of being told something Slurm would not say. The ``slurm_cluster`` fixture (tests/conftest.py) runs the same
scenarios against this fake and (slow tier) the real test cluster (tests/integration/test_control_plane_slurm.py,
test_time_limit_requeue.py), so the fake cannot drift from what Slurm prints.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import json
import os
import re
import shlex
import sys
from pathlib import Path

COMMANDS = ("sbatch", "sacct", "squeue", "scancel", "scontrol", "sinfo", "srun")
FINISHED = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
            "OUT_OF_MEMORY")
NODES = ("n1", "n2")
CPUS_PER_NODE = 4
MEM_MB = 7900
PARTITION = "debug"


class FakeSlurm:
    """The fake's folder (``bin/`` with the commands, ``state.json``) and the test's handle on its state."""

    def __init__(self, root: str | Path, nodes: tuple[str, ...] = NODES):
        self.root = Path(root)
        self.bin = self.root / "bin"
        self.bin.mkdir(parents=True, exist_ok=True)
        self.state_file = self.root / "state.json"
        if not self.state_file.exists():
            _write(self.state_file, {"next_id": 1, "nodes": list(nodes), "jobs": {}, "calls": []})
        for name in COMMANDS:
            shim = self.bin / name
            shim.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -S {shlex.quote(__file__)} "
                            f"{shlex.quote(str(self.state_file))} {name} \"$@\"\n")
            shim.chmod(0o755)

    @property
    def path(self) -> str:
        """PATH with the fake's commands first."""
        return os.pathsep.join([str(self.bin), os.environ.get("PATH", "")])

    def env(self) -> dict[str, str]:
        return {"PATH": self.path}

    def state(self) -> dict:
        return json.loads(self.state_file.read_text())

    def jobs(self) -> dict[str, dict]:
        return self.state()["jobs"]

    def job(self, job_id: str) -> dict:
        return self.jobs()[str(job_id)]

    def calls(self, command: str | None = None) -> list[list[str]]:
        return [c for c in self.state()["calls"] if command is None or c[0] == command]

    def set_state(self, job_id: str, state: str, exit_code: str | None = None, elapsed: str | None = None,
                  nodelist: str | None = None) -> None:
        """Give job ``job_id`` the state sacct will print from now on."""
        with _Locked(self.state_file) as st:
            job = st["jobs"][str(job_id)]
            job["state"] = state
            if exit_code is not None:
                job["exit_code"] = exit_code
            if elapsed is not None:
                job["elapsed"] = elapsed
            job["nodelist"] = nodelist if nodelist is not None else job["nodelist"] or st["nodes"][0]


# -- the commands (run as ``python -S fake_slurm.py STATE COMMAND ARGS...``) -------------------------------------------
class _Locked:
    """The state, read under an exclusive lock and written back (atomically) when the block succeeds."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self) -> dict:
        self.fd = os.open(self.path.with_suffix(".lock"), os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        self.state = json.loads(self.path.read_text())
        return self.state

    def __exit__(self, kind, value, tb) -> None:
        try:
            if kind is None:
                _write(self.path, self.state)
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)


def _write(path: Path, state: dict) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, path)


def _options(args: list[str]) -> tuple[dict[str, str], list[str]]:
    """``--key=value``/``--flag`` and ``-k value`` options -> {key: value}, and the other arguments in order."""
    opts, rest, i = {}, [], 0
    takes_value = {"-o", "-j", "-J", "-t", "-p", "--format", "--jobs", "--signal", "--state"}
    while i < len(args):
        a = args[i]
        if a.startswith("--") and "=" in a:
            key, value = a[2:].split("=", 1)
            opts[key] = value
        elif a in takes_value and i + 1 < len(args):
            opts[a.lstrip("-")] = args[i + 1]
            i += 1
        elif a.startswith("-") and len(a) > 1:
            opts[a.lstrip("-")] = ""
        else:
            rest.append(a)
        i += 1
    return opts, rest


def _now() -> str:
    return _dt.datetime.now().replace(microsecond=0).isoformat()


def sbatch(st: dict, args: list[str]) -> tuple[int, str, str]:
    opts, rest = _options(args)
    if not rest:
        return 1, "", "sbatch: error: the fake takes a script file (no --wrap, no stdin)\n"
    if "wait" in opts:
        return 2, "", "sbatch: error: the fake never runs a job, so it cannot --wait for one\n"
    script = Path(rest[0])
    if not script.is_file():
        return 1, "", f"sbatch: error: Unable to open file {script}\n"
    directives = dict(_options([ln[len("#SBATCH"):].strip() for ln in script.read_text().splitlines()
                                if ln.startswith("#SBATCH")])[0])
    directives.update(opts)
    if "array" in directives:
        return 2, "", "sbatch: error: the fake hands out no job arrays\n"
    job_id = str(st["next_id"])
    if "test-only" in opts:
        return 0, "", (f"sbatch: Job {job_id} to start at {_now()} using 1 processors on nodes {st['nodes'][0]} in "
                       f"partition {directives.get('partition', PARTITION)}\n")
    st["next_id"] += 1
    base = {"name": directives.get("job-name", directives.get("J", script.name)), "state": "PENDING",
            "exit_code": "0:0", "elapsed": "00:00:00", "nodelist": "", "script": str(script.resolve()),
            "options": opts, "cwd": os.getcwd(), "submitted": _now(),
            "env": {k: v for k, v in os.environ.items() if k.startswith("HPC_TOOLS_")}}
    st["jobs"][job_id] = base
    out = f"{job_id}\n" if "parsable" in opts else f"Submitted batch job {job_id}\n"
    return 0, out, ""


def _matching(st: dict, ids: list[str]) -> list[tuple[str, dict]]:
    """The jobs asked for, in submission order."""
    return [(job_id, job) for job_id, job in st["jobs"].items() if job_id in ids]


SACCT_FIELDS = {"jobid": lambda i, j: i, "state": lambda i, j: j["state"], "exitcode": lambda i, j: j["exit_code"],
                "elapsed": lambda i, j: j["elapsed"], "nodelist": lambda i, j: j["nodelist"] or "None assigned",
                "jobname": lambda i, j: j["name"]}


def sacct(st: dict, args: list[str]) -> tuple[int, str, str]:
    opts, _ = _options(args)
    fields = (opts.get("o") or opts.get("format") or "JobID,State").split(",")
    unknown = [f for f in fields if f.lower() not in SACCT_FIELDS]
    if unknown:
        return 2, "", f"sacct: the fake prints no {unknown}\n"
    ids = (opts.get("j") or opts.get("jobs") or "").split(",")
    lines = [] if "n" in opts or "noheader" in opts else ["|".join(fields)]
    lines += ["|".join(SACCT_FIELDS[f.lower()](job_id, job) for f in fields) for job_id, job in _matching(st, ids)]
    return 0, "".join(line + "\n" for line in lines), ""


def squeue(st: dict, args: list[str]) -> tuple[int, str, str]:
    opts, _ = _options(args)
    jobs = _matching(st, (opts.get("j") or opts.get("jobs") or "").split(","))
    if not jobs:
        return 1, "", "slurm_load_jobs error: Invalid job id specified\n"
    live = [(i, j) for i, j in jobs if j["state"].split()[0] not in FINISHED]
    if "s" in opts:  # steps: the fake runs none, so a live job shows its batch step only
        return 0, "".join(f"{i}.batch\n" for i, j in live if j["state"] == "RUNNING"), ""
    if opts.get("o") == "%T":
        return 0, "".join(f"{j['state'].split()[0]}\n" for i, j in live), ""
    return 0, "".join(f"{i} {PARTITION} {j['name'][:8]} root {j['state'][:2]} 0:00 1 {j['nodelist']}\n"
                      for i, j in live), ""


def scancel(st: dict, args: list[str]) -> tuple[int, str, str]:
    opts, ids = _options(args)
    unknown = [i for i in ids if i.split(".")[0].split("_")[0] not in st["jobs"]]
    if unknown:  # Slurm's words and status for a job it never had
        return 1, "", f"scancel: error: Kill job error on job id {unknown[0]}: Invalid job id specified\n"
    for job_id, job in _matching(st, ids):
        if "signal" in opts:
            job.setdefault("signals", []).append(opts["signal"])
        elif job["state"].split()[0] not in FINISHED:
            job["state"] = f"CANCELLED by {os.getuid()}"
    return 0, "", ""


def scontrol(st: dict, args: list[str]) -> tuple[int, str, str]:
    if args[:1] == ["ping"]:
        return 0, "Slurmctld(primary) at fake is UP\n", ""
    if args[:2] == ["show", "hostnames"]:
        m = re.match(r"^(.*)\[(\d+)-(\d+)\]$", args[2])
        hosts = [f"{m.group(1)}{n}" for n in range(int(m.group(2)), int(m.group(3)) + 1)] if m else args[2].split(",")
        return 0, "".join(h + "\n" for h in hosts), ""
    if args[:3] == ["show", "job", "-o"] or args[:1] in (["requeue"], ["update"]):
        return _job_control(st, args)
    if args[:3] == ["show", "node", "-o"] and args[3:4] and args[3] in st["nodes"]:
        return 0, f"NodeName={args[3]} State=IDLE CPUTot={CPUS_PER_NODE} Partitions={PARTITION}\n", ""
    if args[:2] == ["show", "config"]:
        return 0, "Configuration data as of fake\nClusterName = fake\nMaxArraySize = 1001\nMaxJobCount = 10000\n", ""
    if args[:2] == ["show", "topology"]:
        return 1, "", "scontrol: error: No topology information available\n"  # topology/flat, Slurm's default
    return 2, "", f"scontrol: the fake does not answer {' '.join(args)!r}\n"


def _job_control(st: dict, args: list[str]) -> tuple[int, str, str]:
    """``scontrol show job -o J``, ``requeue J``, ``update JobId=J ExcNodeList=...`` of a job the fake knows."""
    fields = dict(a.split("=", 1) for a in args[1:] if "=" in a)
    job_id = fields.get("JobId") or args[-1]
    job = st["jobs"].get(job_id)
    if job is None:
        return 1, "", f"scontrol: error: Invalid job id specified ({job_id})\n"
    if args[0] == "requeue":
        if job["state"].split()[0] in FINISHED or job["state"] == "PENDING":
            return 1, "", "scontrol: error: Job is no longer running\n"
        job["state"] = "PENDING"
        return 0, "", ""
    if args[0] == "update":
        job["excluded"] = fields.get("ExcNodeList", "")
        return 0, "", ""
    out = os.path.join(job["cwd"], f"slurm-{job_id}.out")
    return 0, (f"JobId={job_id} JobName={job['name']} JobState={job['state'].split()[0]} "
               f"NodeList={job['nodelist'] or '(null)'} StdOut={out}\n"), ""


def srun(st: dict, args: list[str]) -> tuple[int, str, str]:
    """There for submitit's start-up check (it refuses to submit where ``srun`` is missing); nothing runs here."""
    return 2, "", "srun: the fake runs no job steps\n"


def sinfo(st: dict, args: list[str]) -> tuple[int, str, str]:
    opts, _ = _options(args)
    fmt = opts.get("format") or opts.get("o") or ""
    if fmt == "%D":
        return 0, f"{len(st['nodes'])}\n", ""
    if fmt in ("%N", "%m"):  # one line per node (-N): its name, or its memory in MB
        return 0, "".join(f"{n if fmt == '%N' else MEM_MB}\n" for n in st["nodes"]), ""
    if fmt == "%P|%a|%l|%s|%G|%c|%N":
        return 0, "".join(f"{PARTITION}*|up|infinite|1-infinite|(null)|{CPUS_PER_NODE}|{n}\n" for n in st["nodes"]), ""
    return 2, "", f"sinfo: the fake does not answer {' '.join(args)!r}\n"


def main(argv: list[str]) -> int:
    state_file, command, args = Path(argv[0]), argv[1], argv[2:]
    with _Locked(state_file) as st:
        st["calls"].append([command, *args])
        code, out, err = globals()[command](st, args)
    sys.stdout.write(out)
    sys.stderr.write(err)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
