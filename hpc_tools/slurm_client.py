"""The one Slurm client: every call of Slurm's commands (``sbatch``, ``squeue``, ``sacct``, ``scancel``,
``scontrol``, ``sinfo`` and the ``srun`` probe) goes through this module, with one set of one-line errors.

Standard library only (and ``hpc_tools.errors``): the batch shell's steps import it on the batch host, where a
pyxis job runs the host's ``python3`` without the package's dependencies. A test swaps the whole client by putting
``hpc_tools.testing.fake_slurm``'s commands first on PATH (every function here runs the command found on PATH, as
submitit does), so nothing in the package calls Slurm another way (tests/unit/test_slurm_client.py greps for it).

The three ways a call fails, each one line (``SlurmError``, a ``UserError``), the same for every command:

- **not installed**: the command is not on PATH, or ``HPC_TOOLS_SLURM=off`` turns Slurm off here;
- **no controller**: the client is there but its controller does not answer (no configuration source, connection
  refused, a timeout);
- **refused**: the controller answered no (an invalid partition, an unknown job): Slurm's own last line.

``HPC_TOOLS_SLURM=off`` makes ``validate``, ``submit``, ``sweep``, ``resume``, ``serve``, ``eval`` and ``doctor``
treat the machine as one without Slurm (no ``sinfo`` asked, ``submit`` runs locally), for a laptop or workstation
that has Slurm's client installed and no cluster to talk to; unset (or ``auto``), Slurm is used where its commands
are on PATH. The ranks of a job never read it: inside a Slurm job, Slurm's commands are what they are. The test
suite sets it for every test that does not ask for a Slurm cluster (tests/conftest.py).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

from hpc_tools.errors import UserError

ENV = "HPC_TOOLS_SLURM"
VALUES = ("auto", "off")
COMMANDS = ("sbatch", "squeue", "sacct", "sacctmgr", "scancel", "scontrol", "sinfo", "srun")
NOT_INSTALLED, NO_CONTROLLER, REFUSED = "not installed", "no controller", "refused"
# What Slurm's client prints when it has no controller to talk to (Slurm 22.05-24.x wording).
_NO_CONTROLLER = re.compile(r"contact slurm controller|configuration source|socket timed out|connection refused|"
                            r"connect failure|zero bytes were transmitted|unable to establish|timed out",
                            re.IGNORECASE)
RETRY = ("retry when it is back (`scontrol ping` says UP), or run here with --executor local (HPC_TOOLS_SLURM=off: "
         "always, on a machine whose Slurm client has no cluster)")


class SlurmError(UserError):
    """A Slurm command that did not do what was asked, in one line; ``kind``: NOT_INSTALLED, NO_CONTROLLER or
    REFUSED."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


def off_reason() -> str | None:
    """``HPC_TOOLS_SLURM=off`` when it turns Slurm off here, else None; a value other than off/auto is an error."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value == "off":
        return f"{ENV}=off"
    raise UserError(f"{ENV}={os.environ[ENV]!r} is not one of {', '.join(VALUES)} (off: no Slurm on this machine; "
                    "auto, or unset: Slurm where its commands are on PATH)")


def absent_reason(name: str) -> str | None:
    """Why Slurm's client command ``name`` (``sbatch``, ``sinfo``) is not run here: ``HPC_TOOLS_SLURM=off`` or
    ``NAME is not on PATH``; None when it is on PATH and Slurm is not turned off."""
    return off_reason() or (None if shutil.which(name) else f"{name} is not on PATH")


@dataclass(frozen=True, slots=True)
class Answer:
    """What one Slurm command did: ``kind`` None when it exited 0, else how it failed; ``said``: its last line (or
    why it did not run)."""

    argv: tuple[str, ...]
    kind: str | None
    out: str = ""
    said: str = ""
    code: int | None = 0

    @property
    def ok(self) -> bool:
        return self.kind is None

    def error(self, doing: str = "", fix: str = "") -> SlurmError:
        """The one line for this failure; ``doing`` names what was asked (default: the command line's first
        words), ``fix`` replaces the default advice of a refusal."""
        what = doing or " ".join(self.argv[:3])
        if self.kind == NOT_INSTALLED:
            return SlurmError(f"no Slurm here ({self.said}): {what} cannot run (run on a Slurm login node, or use "
                              "--executor local)", NOT_INSTALLED)
        if self.kind == NO_CONTROLLER:
            return SlurmError(f"Slurm is installed but its controller does not answer ({self.said}); {RETRY}",
                              NO_CONTROLLER)
        return SlurmError(f"Slurm refused {what}: {self.said}" + (f" ({fix})" if fix else ""), REFUSED)

    def check(self, doing: str = "", fix: str = "") -> str:
        """stdout when the command succeeded, else its one-line error raised."""
        if not self.ok:
            raise self.error(doing, fix)
        return self.out


def last_line(text: str, command: str = "") -> str:
    """The last non-empty line of what a command printed, without its own ``NAME:`` prefix."""
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    line = lines[-1] if lines else ""
    return line.removeprefix(f"{command}:").strip() if command else line


def call(argv: list[str], timeout: float = 30.0, env: dict[str, str] | None = None, cwd=None,
         run=subprocess.run, job_side: bool = False) -> Answer:
    """Run one Slurm command; never raises. ``env`` is added to this process's environment; ``run`` stands in for
    ``subprocess.run`` (a test's runner, which is Slurm for that call). ``job_side``: asked by a job's own steps on
    its nodes, where ``HPC_TOOLS_SLURM`` is not read (inside a job, Slurm's commands are what they are)."""
    name = argv[0]
    if name not in COMMANDS:
        raise ValueError(f"{name} is not one of Slurm's commands {COMMANDS}")
    absent = None if run is not subprocess.run else (
        (None if shutil.which(name) else f"{name} is not on PATH") if job_side else absent_reason(name))
    if absent:
        return Answer(tuple(argv), NOT_INSTALLED, said=absent, code=None)
    try:
        out = run(list(argv), capture_output=True, text=True, timeout=timeout, cwd=cwd,
                  env={**os.environ, **env} if env else None)
    except subprocess.TimeoutExpired:
        return Answer(tuple(argv), NO_CONTROLLER, said=f"{name} did not answer within {timeout:g} s", code=None)
    except OSError as exc:
        return Answer(tuple(argv), NOT_INSTALLED, said=f"{name}: {exc.strerror or exc}", code=None)
    if out.returncode == 0:
        return Answer(tuple(argv), None, out.stdout or "", "", 0)
    said = last_line(out.stderr, name) or last_line(out.stdout, name) or f"exit code {out.returncode}"
    kind = NO_CONTROLLER if _NO_CONTROLLER.search((out.stderr or "") + (out.stdout or "")) else REFUSED
    return Answer(tuple(argv), kind, out.stdout or "", f"{name}: {said}", out.returncode)


# -- the controller ---------------------------------------------------------------------------------------------------
def ping(timeout: float = 5.0) -> tuple[bool, str]:
    """(True, "") when ``scontrol ping`` reports a controller UP (and ``sbatch`` is here to submit to it); else
    (False, why)."""
    absent = absent_reason("sbatch")
    if absent:
        return False, absent
    answer = call(["scontrol", "ping"], timeout)
    if answer.kind == NOT_INSTALLED:
        return False, answer.said
    if not answer.ok or " is UP" not in answer.out:
        return False, answer.said or f"scontrol: {last_line(answer.out) or 'no controller UP'}"
    return True, ""


def show_config(run=subprocess.run) -> dict[str, str]:
    """``scontrol show config`` as a mapping (``MaxArraySize`` -> ``"1001"``); raises SlurmError in one line when
    Slurm does not answer (``run``: the command runner)."""
    text = call(["scontrol", "show", "config"], 30, run=run).check("scontrol show config")
    config = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() and " " not in key.strip():
            config[key.strip()] = value.strip()
    return config


def show_topology(timeout: float = 3.0) -> Answer:
    """``scontrol show topology`` (tree or block plugin): the answer, parsed by ``hpc_tools.topology``."""
    return call(["scontrol", "show", "topology"], timeout)


def hostnames(nodelist: str, timeout: float = 30.0) -> list[str]:
    """``scontrol show hostnames NODELIST`` (``n[1-3]`` -> n1, n2, n3); [] when Slurm does not answer."""
    if not nodelist:
        return []
    answer = call(["scontrol", "show", "hostnames", nodelist], timeout, job_side=True)
    return answer.out.split() if answer.ok else []


def show_job(job_id: str, timeout: float = 30.0) -> dict[str, str]:
    """``scontrol show job -o JOB_ID`` as a mapping (``NodeList``, ``StdOut``, ...); {} when Slurm does not know
    the job or does not answer."""
    if not job_id:
        return {}
    answer = call(["scontrol", "show", "job", "-o", str(job_id)], timeout, job_side=True)
    return dict(item.split("=", 1) for item in answer.out.split() if "=" in item) if answer.ok else {}


def show_node(node: str, timeout: float = 30.0) -> dict[str, str]:
    """``scontrol show node -o NODE`` as a mapping (``State``, ``Reason``, ...); {} when Slurm does not answer."""
    answer = call(["scontrol", "show", "node", "-o", node], timeout)
    return dict(item.split("=", 1) for item in answer.out.split() if "=" in item) if answer.ok else {}


def exclude_nodes(job_id: str, nodes: list[str], timeout: float = 30.0) -> str | None:
    """``scontrol update JobId=J ExcNodeList=...`` (a pending job): None when Slurm took it, else its words."""
    answer = call(["scontrol", "update", f"JobId={job_id}", f"ExcNodeList={','.join(nodes)}"], timeout,
                  job_side=True)
    return None if answer.ok else answer.said


def requeue(job_id: str, run=subprocess.run) -> str | None:
    """``scontrol requeue JOB_ID``: None when Slurm took it, else what Slurm said (``run``: the command runner)."""
    answer = call(["scontrol", "requeue", str(job_id)], 30, run=run, job_side=True)
    return None if answer.ok else answer.said


# -- jobs -------------------------------------------------------------------------------------------------------------
def sbatch(script, env: dict[str, str] | None = None, options=(), cwd=None, what: str = "", fix: str = "") -> str:
    """``sbatch --parsable OPTIONS SCRIPT`` with ``env`` added to this process's environment (sbatch exports it to
    the job, and Slurm keeps it for a requeue); the job id, or SlurmError in one line (``what``: the job in words,
    ``fix``: what to do when Slurm refuses it)."""
    answer = call(["sbatch", "--parsable", *options, str(script)], 60, env=env or {}, cwd=cwd)
    return answer.check(f"{what or 'the job'} ({script})", fix).strip().split(";")[0]


def scancel(job_id: str, signal: str | None = None, timeout: float = 15.0, job_side: bool = False) -> None:
    """``scancel [--signal=SIG] JOB_ID`` (a job, an array task or a step ``JOB.N``; ``job_side``: from the job's own
    batch shell); SlurmError in one line when Slurm does not take it."""
    call(["scancel", *([f"--signal={signal}"] if signal else []), str(job_id)], timeout,
         job_side=job_side).check(f"scancel {job_id}")


def job_state(job_id: str, timeout: float = 20.0) -> str | None:
    """squeue's state of a job (``PENDING``, ``RUNNING``, ``COMPLETING``...); "" once squeue no longer lists it;
    None when Slurm does not answer (unknown, so not declared gone)."""
    answer = call(["squeue", "-h", "-j", str(job_id), "-o", "%T"], timeout)
    if answer.ok:
        return answer.out.strip()
    return "" if answer.kind == REFUSED and "invalid job id" in answer.said.lower() else None


def job_steps(job_id: str, timeout: float = 30.0) -> list[str]:
    """The job's running steps as squeue lists them (``JOB.N``, ``JOB.batch``, ``JOB.extern``); [] when none or
    when Slurm does not answer."""
    answer = call(["squeue", "-h", "-s", "-j", str(job_id), "-o", "%i"], timeout, job_side=True)
    return answer.out.split() if answer.ok else []


def sacct(job_ids: list[str], fields: list[str] | tuple[str, ...], duplicates: bool = False,
          timeout: float = 20.0) -> str | None:
    """``sacct -X -n -P -o FIELDS -j IDS`` (``duplicates``: every life of a requeued job); its text, or None when
    sacct is missing, refuses or does not answer in time."""
    argv = ["sacct", "-X", "-n", "-P", *(["--duplicates"] if duplicates else []), "-o", ",".join(fields),
            "-j", ",".join(job_ids)]
    answer = call(argv, timeout)
    return answer.out if answer.ok else None


# -- nodes ------------------------------------------------------------------------------------------------------------
def sinfo(args: list[str], timeout: float = 30.0) -> Answer:
    """``sinfo ARGS`` (the answer: callers parse their own format)."""
    return call(["sinfo", *args], timeout)


def partition_nodes(partition: str | None = None, timeout: float = 30.0, job_side: bool = False) -> list[str]:
    """The nodes of ``partition`` (every partition's for None), whatever their state; [] when Slurm does not
    answer (``job_side``: asked from a job's batch shell)."""
    answer = call(["sinfo", "-h", "-N", "-o", "%N", *(["-p", partition] if partition else [])], timeout,
                  job_side=job_side)
    return list(dict.fromkeys(answer.out.split())) if answer.ok else []


def node_memory_mb(partition: str | None = None, timeout: float = 20.0) -> list[int]:
    """Each node's memory in MB (``sinfo %m``) in ``partition``; [] when Slurm does not answer."""
    answer = sinfo(["-h", "-N", "-o", "%m", *(["-p", partition] if partition else [])], timeout)
    return [int(x) for x in answer.out.split() if x.isdigit()] if answer.ok else []


def probe(node: str, timeout: float = 30.0) -> bool:
    """Whether ``node``'s slurmd runs a step of this job (``srun true`` there, overlapping the job's other steps)."""
    return call(["srun", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={node}", "--cpus-per-task=1",
                 "--mem=0", "--kill-on-bad-exit=1", "true"], timeout, job_side=True).ok


def srun_help(timeout: float = 10.0) -> str:
    """``srun --help`` (its options show which SPANK plugins are loaded: pyxis adds --container-image); "" when
    srun does not run."""
    answer = call(["srun", "--help"], timeout)
    return answer.out + answer.said
