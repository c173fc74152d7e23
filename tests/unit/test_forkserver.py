"""The fork server starts each rank as ``subprocess.Popen(start_new_session=True, pass_fds=...)`` would: its own
session, exactly its environment, descriptors and working directory, stdin from /dev/null, the program as
``__main__``; exit codes as ``Popen.returncode``; the imports' warnings raised again in the rank. Small programs
without torch (the preload is a module of the test's own), so this runs in the fast tier; the local runs' losses
forked and not forked are compared in tests/integration/test_forkserver_runs.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from hpc_tools.runtime import forkserver

PROGRAM = """
import json, os, sys, warnings
from hpc_tools.runtime import forkserver
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    forkserver.replay_warnings()
fds = sorted(int(f) for f in os.listdir("/proc/self/fd"))
print(json.dumps({"argv": sys.argv[1:], "name": __name__, "rank": os.environ.get("RANK"),
                  "env": sorted(os.environ), "own_session": os.getsid(0) == os.getpid(),
                  "parent_is_server": os.getppid() != int(os.environ["CALLER_PID"]),
                  "fds": fds, "stdin": os.readlink("/proc/self/fd/0"), "cwd": os.getcwd(),
                  "warned": [str(w.message) for w in caught], "preloaded": "warner" in sys.modules}))
sys.stdout.flush()
what = os.environ.get("THEN", "exit0")
if what == "kill9":
    os.kill(os.getpid(), 9)
if what == "sleep":
    import time
    time.sleep(60)
if what == "leave":  # what a normal exit finishes: an unclosed file, a non-daemon thread, an atexit handler
    import atexit, threading, time
    kept = open(os.environ["OUT"] + ".unclosed", "w")
    kept.write("flushed")
    def late():
        time.sleep(0.3)
        open(os.environ["OUT"] + ".thread", "w").write("joined")
    threading.Thread(target=late).start()
    atexit.register(lambda: open(os.environ["OUT"] + ".atexit", "w").write("ran"))
    sys.exit("a message for stderr")
sys.exit(int(what[4:]) if what.startswith("exit") else 0)
"""


@pytest.fixture
def program(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    (tmp_path / "warner.py").write_text("import warnings\nwarnings.warn('imported in the server')\n"
                                        "def setup():\n    warnings.warn('set up in the server')\n")
    return script


def _envs(tmp_path, n, **extra):
    base = {"PATH": os.environ.get("PATH", ""), "CALLER_PID": str(os.getpid()),
            "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]), **extra}
    return [{**base, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(n)]


def _run(argv, envs, preload=(), rank0_fds=(), cwd=None, timeout=60):
    ranks = forkserver.start(argv, envs, [None] * len(envs), preload=preload, rank0_fds=rank0_fds, cwd=cwd)
    outs = [r.stdout.read().decode() for r in ranks]
    codes = [r.wait(timeout) for r in ranks]
    return ranks, codes, outs


def _report(out: str) -> dict:
    return json.loads(next(line for line in out.splitlines() if line.startswith("{")))


def test_each_rank_starts_as_popen_would_start_it(program, tmp_path):
    keep_r, keep_w = os.pipe()  # rank 0's extra descriptor (the rendezvous socket in a real run)
    try:
        ranks, codes, outs = _run([sys.executable, str(program), "--x", "1"], _envs(tmp_path, 3),
                                  preload=("warner:setup",), rank0_fds=(keep_w,), cwd=str(tmp_path))
    finally:
        os.close(keep_r)
        os.close(keep_w)
    assert codes == [0, 0, 0], outs
    reports = [_report(o) for o in outs]
    for rank, (proc, rep) in enumerate(zip(ranks, reports)):
        assert rep["argv"] == ["--x", "1"] and rep["name"] == "__main__"
        assert rep["rank"] == str(rank) and rep["own_session"] and rep["parent_is_server"]
        assert set(rep["env"]) == set(_envs(tmp_path, 1)[0])
        assert rep["stdin"] == "/dev/null" and rep["cwd"] == str(tmp_path)
        assert rep["preloaded"]  # imported once, in the server, before the fork
        assert rep["warned"] == ["imported in the server", "set up in the server"]
        extra = set(rep["fds"]) - {0, 1, 2}
        assert len(extra) == (2 if rank == 0 else 1), rep["fds"]  # listdir's own, and rank 0 its pipe end
    assert len({p.pid for p in ranks}) == 3 and all(p.pid != os.getpid() for p in ranks)


def test_a_rank_sees_exactly_the_environment_it_was_given(program, tmp_path):
    envs = _envs(tmp_path, 2)
    envs[1]["ONLY_RANK_1"] = "yes"
    _, codes, outs = _run([sys.executable, str(program)], envs)
    assert codes == [0, 0]
    assert set(_report(outs[0])["env"]) == set(envs[0])
    assert set(_report(outs[1])["env"]) == set(envs[1])


def test_exit_codes_are_popens_and_a_module_runs_as_main(program, tmp_path):
    envs = _envs(tmp_path, 3)
    envs[1]["THEN"], envs[2]["THEN"] = "exit3", "kill9"
    _, codes, outs = _run([sys.executable, str(program)], envs)
    assert codes == [0, 3, -signal.SIGKILL]
    envs = _envs(tmp_path, 1, THEN="exit5")
    (tmp_path / "progmod.py").write_text(  # imported by the server, run again as __main__ in the rank
        "if __name__ == '__main__':\n    exec(compile(open('prog.py').read(), 'prog.py', 'exec'))\n")
    _, codes, outs = _run([sys.executable, "-m", "progmod", "a"], envs, preload=("progmod",), cwd=str(tmp_path))
    assert codes == [5] and _report(outs[0])["argv"] == ["a"] and _report(outs[0])["name"] == "__main__"


def test_a_forked_program_ends_as_a_normal_exit_would_end_it(program, tmp_path):
    out = tmp_path / "left"
    _, codes, outs = _run([sys.executable, str(program)], _envs(tmp_path, 1, THEN="leave", OUT=str(out)))
    assert codes == [1] and "a message for stderr" in outs[0]
    for suffix, text in ((".unclosed", "flushed"), (".thread", "joined"), (".atexit", "ran")):
        assert (tmp_path / f"left{suffix}").read_text() == text, suffix


@pytest.mark.parametrize("failing", ["no_such_module_here:run", "sys:exit"])
def test_a_failing_preload_leaves_the_import_to_the_ranks(program, tmp_path, failing):
    _, codes, outs = _run([sys.executable, str(program)], _envs(tmp_path, 2), preload=(failing, "warner"))
    assert codes == [0, 0]
    assert not _report(outs[1])["preloaded"]  # nothing after the failing one


def test_stopping_a_rank_by_its_process_group_and_a_lost_server(program, tmp_path):
    ranks = forkserver.start([sys.executable, str(program)], _envs(tmp_path, 2, THEN="sleep"), [None, None])
    assert all(r.poll() is None for r in ranks)
    cmdline = open(f"/proc/{ranks[1].pid}/cmdline", "rb").read().split(b"\0")
    assert str(program).encode() in cmdline and b"hpc_tools.runtime.forkserver" in cmdline  # what `ps` shows
    os.killpg(ranks[0].pid, signal.SIGTERM)  # what stop_ranks does
    assert ranks[0].wait(30) == -signal.SIGTERM
    with pytest.raises(subprocess.TimeoutExpired):
        ranks[1].wait(0.2)
    parent = int(open(f"/proc/{ranks[1].pid}/stat").read().rsplit(")", 1)[1].split()[1])
    os.kill(parent, signal.SIGKILL)  # the server dies: the rank's exit can no longer be reported
    time.sleep(0.5)
    assert ranks[1].poll() is None  # still running
    os.killpg(ranks[1].pid, signal.SIGKILL)
    assert ranks[1].wait(30) == 1  # settled once it is gone


def test_usable_only_for_cpu_ranks_of_this_python(monkeypatch):
    monkeypatch.setattr(forkserver, "cpu_torch", lambda: True)  # torch's CPU build, as on this project's CI
    assert forkserver.usable([sys.executable, "-m", "hpc_tools.runtime.rank"], uses_gpus=False)
    assert forkserver.usable([sys.executable, "x.py"], uses_gpus=False)
    assert not forkserver.usable([sys.executable, "-m", "hpc_tools.runtime.rank"], uses_gpus=True)
    assert not forkserver.usable(["/bin/echo", "-m", "x"], uses_gpus=False)
    assert not forkserver.usable([sys.executable, "-c", "pass"], uses_gpus=False)
    monkeypatch.setenv("HPC_TOOLS_FORKSERVER", "0")
    assert not forkserver.usable([sys.executable, "x.py"], uses_gpus=False)
    monkeypatch.delenv("HPC_TOOLS_FORKSERVER")
    monkeypatch.setattr(forkserver, "cpu_torch", lambda: False)  # a CUDA build of torch: never forked
    assert not forkserver.usable([sys.executable, "x.py"], uses_gpus=False)
