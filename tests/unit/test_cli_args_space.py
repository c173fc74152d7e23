"""A property over the command-line space, as test_recipe_space.py is over the recipe space: whatever arguments the
commands that take them are given (eval, quantize, serve, generate, export, cancel, preflight, resume, logs, status,
list, sweep, report), each answers in its own terms -- exit 0, 1 or 2, never a traceback -- and when it refuses
(exit 1 or 2) it wrote nothing and started nothing.

The command lines are drawn from the argparse parsers themselves (``tests/unit/cli_strategies.py``): every action of
every command, with hostile values for its type and purpose. They run in this process (``hpc_tools.cli.main``) with
Slurm off (``HPC_TOOLS_SLURM=off``) against a fixture world: a completed synthetic run (real run folder, real
records), a model folder, a file, a non-empty folder, shipped recipes. The points where a command would start
something long-running -- a rank, a server, a job, an evaluation, a model load, a request, a signal -- are replaced
by a stand-in that records the start and stops the command there (``WouldStart``); each of those paths is run for
real by its own tests (test_serve.py, test_evaluate.py, test_resume.py, test_sweep_slurm.py, test_preflight_local.py,
test_quantize_gpt_serve.py). A command line that reaches one was accepted; the property then asks only for no
traceback before it. The fast tier draws a bounded, derandomized sample; the slow tier many more.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import signal
import subprocess
import tempfile
import traceback
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import note as hypothesis_note
from hypothesis import strategies as st

from hpc_tools.cli import main
from tests.unit.cli_strategies import Line, Places, command_lines

REPO = Path(__file__).resolve().parents[2]


class WouldStart(BaseException):
    """Raised by a stand-in for a launch point: the command got as far as starting something."""


class CommandTimeout(Exception):
    pass


# Wall seconds for one command on the fixture (they take milliseconds to a few seconds): more is a hang, a defect of
# its own (``logs -f`` of a served folder whose server never started polled forever). Wall, not CPU, time: a hang
# sleeps.
COMMAND_LIMIT_S = 120.0


@contextmanager
def time_limit(seconds: float):
    def expired(*_):
        raise CommandTimeout(f"still running after {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# module, attribute: the launch points (the command's code imports them at call time, so patching the module holds)
LAUNCHES = (("hpc_tools.executors.local", "run_local"), ("hpc_tools.serving.job", "start"),
            ("hpc_tools.resume", "launch"), ("hpc_tools.sweep.runner", "submit_cells"),
            ("hpc_tools.evaluate.evaljob", "run_local"), ("hpc_tools.evaluate.evaljob", "submit_array"),
            ("hpc_tools.evaluate.quantize", "_quantized_save"), ("hpc_tools.evaluate.target", "ensure_exported"),
            ("hpc_tools.serving.client", "infer_many"), ("hpc_tools.executors.slurm", "cancel"),
            ("hpc_tools.serving.job", "export_for_serving"), ("os", "killpg"), ("os", "kill"))


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Places:
    from hpc_tools.testing.synthetic import synthetic_run

    base = tmp_path_factory.mktemp("cli-space")
    root = base / "runs"
    rng = np.random.default_rng(0)
    run = synthetic_run(root, [], 0.1 + 0.01 * rng.random((2, 12)), loss=np.tile(np.linspace(5, 3, 12), (2, 1)))
    (root / "sweeps").mkdir()  # sweep references are looked up here
    model = base / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "gpt2", "n_head": 2, "n_embd": 8, "n_layer": 1, '
                                       '"vocab_size": 16, "n_positions": 8}')
    (base / "a-file.txt").write_text("not a folder\n")
    (base / "full").mkdir()
    (base / "full" / "keep.txt").write_text("x")
    scratch = base / "scratch"
    scratch.mkdir()
    return Places(run.run_id, str(run.path), str(root), str(scratch), str(model), str(base / "a-file.txt"),
                  str(base / "full"), str(REPO / "recipes" / "gpt_3d_sweep.yaml"),
                  str(REPO / "recipes" / "llama_fsdp.yaml"))


def note(text: str) -> None:
    """hypothesis' note inside a drawn example; nothing outside one (the explicit cases: their argv is in the id)."""
    from hypothesis.control import _current_build_context

    if _current_build_context.value is not None:
        hypothesis_note(text)


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` with its size and modification time (a write changes one or the other)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            try:
                st = path.lstat()
            except OSError:
                continue
            out[str(path.relative_to(root))] = (st.st_size, st.st_mtime_ns) if name in filenames else (0, 0)
    return out


_DRAWN: dict[bytes, tuple[Path, list[str]]] = {}  # the analysis' digest -> (a copy of its plots, their names)
_DRAWN_DIR = tempfile.TemporaryDirectory(prefix="drawn-plots-")  # removed when the test process ends


def plots_drawn_once(real):
    """``report``'s plots (``analysis.step_plots.all_plots``), drawn for real once per distinct analysis and copied
    into the report folder when the same analysis comes again: a plot is a function of the analysis alone, so a
    second drawing of the same figures can fail nowhere the first did, and rasterizing them was three fifths of
    this module's time (the drawn command lines report the fixture's one run again and again). A report still
    writes its files, so what the property checks of writes is unchanged."""
    def all_plots(a, out):
        try:
            key = hashlib.sha256(pickle.dumps(a)).digest()
        except Exception:  # noqa: BLE001 -- an analysis that does not pickle is drawn every time
            return real(a, out)
        if key not in _DRAWN:
            files = real(a, out)
            keep = Path(tempfile.mkdtemp(dir=_DRAWN_DIR.name))
            for f in files:
                shutil.copy2(f, keep / Path(f).name)
            _DRAWN[key] = (keep, [Path(f).name for f in files])
            return files
        keep, names = _DRAWN[key]
        return [Path(shutil.copy2(keep / name, Path(out) / name)) for name in names]
    return all_plots


def stand_ins(monkeypatch, started: list[str]) -> None:
    import importlib

    import hpc_tools.analysis.report as report

    monkeypatch.setattr(report, "all_plots", plots_drawn_once(report.all_plots))

    def launcher(name):
        def start(*args, **kwargs):
            started.append(name)
            raise WouldStart(name)
        return start

    for module, attr in LAUNCHES:
        monkeypatch.setattr(importlib.import_module(module), attr, launcher(f"{module}.{attr}"))
    # and any child process at all: a command that refuses must not have started one
    monkeypatch.setattr(subprocess.Popen, "__init__", lambda self, cmd, *a, **k: launcher(f"subprocess {cmd!r}")())


def run_one(capsys, argv: list[str]) -> tuple[int | str | None, str, str]:
    """(exit code, or the traceback's text, or None when a launch point was reached; stdout; stderr)."""
    capsys.readouterr()
    try:
        with time_limit(COMMAND_LIMIT_S):
            code: int | str | None = main(argv)
    except SystemExit as exc:  # argparse's refusal (exit 2)
        code = exc.code if isinstance(exc.code, int) else 2
    except WouldStart:
        code = None
    except BaseException as exc:  # noqa: BLE001 -- any other exception is the failure this test looks for
        if isinstance(exc, KeyboardInterrupt):
            raise
        code = "".join(traceback.format_exception(exc))[-3000:]
    out = capsys.readouterr()
    return code, out.out, out.err


def check_command_line(capsys, monkeypatch, world: Places, argv: list[str], must_refuse: str | None = None,
                       ) -> int | None:
    """Run ``argv`` and check the property; its exit code (None: it reached a launch point). ``must_refuse``: why
    the line must be refused (exit 2) whatever the command does with the rest of it."""
    note(f"argv: {argv!r}")
    base = Path(world.runs_root).parent
    started: list[str] = []
    with monkeypatch.context() as m:
        m.setenv("HPC_TOOLS_SLURM", "off")
        m.setenv("HPC_TOOLS_SITE", "none")
        m.setenv("HPC_TOOLS_RUNS_DIR", world.runs_root)
        m.chdir(world.scratch)  # a command's default paths (./runs, ./jobs) land in the watched tree
        stand_ins(m, started)
        before = snapshot(base)
        code, out, err = run_one(capsys, argv)
        after = snapshot(base)
    note(f"exit {code if not isinstance(code, str) else 'traceback'}; started {started}; stderr {err[-600:]!r}")
    assert not isinstance(code, str), f"{argv!r} raised:\n{code}"
    assert "Traceback" not in out + err, f"{argv!r} printed a traceback:\n{err[-2000:]}"
    if must_refuse:
        assert code == 2, f"{argv!r}: {must_refuse}, but it " + (f"exited {code}" if code is not None else
                                                                  f"started {started}")
    if code is None:  # accepted: it reached a launch point (run for real by the tests named in the module doc)
        # what it made for the launch (a run folder, a sweep) would be launched in earnest: not left behind as a run
        # that never starts, which no later example of a real session meets
        for name in sorted(set(after) - set(before), key=len):
            path = base / name
            if path.is_dir() and Path(world.runs_root) in path.parents:
                shutil.rmtree(path, ignore_errors=True)
        return None
    assert code in (0, 1, 2), f"{argv!r} exited {code}:\n{err[-1500:]}"
    assert not started, f"{argv!r} exited {code} after starting {started}"
    if code == 2:  # the refusal is told: an error line, or --json's {"ok": false, "errors": [...]}
        errors = [ln for ln in (out + "\n" + err).splitlines() if ln.startswith("error:") or ": error:" in ln]
        assert errors or '"ok": false' in out, f"{argv!r} exited 2 without an error line:\n{out[-800:]}\n{err[-800:]}"
    if code != 0:
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        assert not changed, f"{argv!r} exited {code} and changed {changed[:10]}"
    # what a successful command wrote under the scratch folder stays out of the next example's way
    for child in Path(world.scratch).iterdir():
        shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    return code


COMMON = dict(deadline=None, database=None, print_blob=True,
              phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                     HealthCheck.data_too_large, HealthCheck.filter_too_much])

# The inputs issue 47 named, kept as explicit examples ({run} and {out} are filled from the fixture world).
ISSUE_47 = [["serve", "{run}", "--gpus", "-1"], ["serve", "{run}", "--ready-timeout", "-1"],
            ["export", "{run}", "--out", "{out}", "--step", "-1"],
            ["generate", "{run}", "--prompt", "hi", "--temperature", "nan"],
            ["sweep", "{recipe}", "--dry-run"]]


# What the property found (each fixed at its source), kept as explicit cases: eval / quantize of a run whose recipe
# leaves training.global_batch_size null (TypeError in evaluate/target.py), a sweep reference that is a path or holds
# glob characters (NotImplementedError / a wrong match in sweep/folder.py).
FOUND = [["eval", "{run}", "--tasks", "x"], ["quantize", "{run}", "--scheme", "int8", "--out", "{out}"],
         ["sweep", "status", "{run_dir}"], ["sweep", "rerun", "[", "--failed"]]


def filled(argv: list[str], world: Places) -> list[str]:
    return [a.format(run=world.run_id, run_dir=world.run_dir, out=str(Path(world.scratch) / "out"),
                     recipe=world.recipe) for a in argv]


@pytest.mark.parametrize("argv", FOUND, ids=lambda a: " ".join(a[:3]))
def test_what_the_property_found(capsys, monkeypatch, world, argv):
    assert check_command_line(capsys, monkeypatch, world, filled(argv, world)) == 2


def test_following_a_served_folder_whose_server_never_started_ends(capsys, monkeypatch, world, tmp_path):
    """Found by the property (a hang): `serve MODEL_DIR` makes a run of kind serve before it starts the server; when
    the server never started, `logs -f` of that run (the latest) polled forever. It ends, as a run that has ended."""
    root = tmp_path / "runs"
    other = Places(**{**world.__dict__, "runs_root": str(root)})
    root.mkdir()
    with monkeypatch.context() as m:  # as check_command_line runs it, but keeping the run serve made
        m.setenv("HPC_TOOLS_SITE", "none")
        # serve refuses before its run without a complete serving environment: one stands in (its server never
        # starts here), so that the test holds on a machine where environment/install-serve.sh has not run yet
        serve_env = tmp_path / "serve-env"
        (serve_env / "bin").mkdir(parents=True)
        (serve_env / "bin" / "python").touch()
        (serve_env / ".hpc_tools-serve-complete").touch()
        m.setenv("HPC_TOOLS_SERVE_ENV", str(serve_env))
        stand_ins(m, [])
        assert run_one(capsys, ["serve", world.model, "--runs-dir", str(root), "--executor", "local"])[0] is None
    assert [p.name.startswith("serve-") for p in root.iterdir()] == [True]  # the serve run, server never started
    assert check_command_line(capsys, monkeypatch, other, ["logs", "-f", "--runs-dir", str(root)]) == 0


@pytest.mark.parametrize("argv", ISSUE_47, ids=lambda a: " ".join(a[:1] + a[2:]))
def test_the_inputs_issue_47_named(capsys, monkeypatch, world, argv):
    argv = filled(argv, world)
    bad = None if argv[0] == "sweep" else f"{argv[-2]} {argv[-1]}"
    assert check_command_line(capsys, monkeypatch, world, argv, bad) == (0 if argv[0] == "sweep" else 2)


@settings(max_examples=80, derandomize=True, **COMMON)
@given(data=st.data())
@example(data=None)
def test_every_drawn_command_line_is_answered(capsys, monkeypatch, world, data):
    if data is None:  # the explicit example: the fixture's own run, as a user would first type it
        line = Line(["status", world.run_id], None)
    else:
        line = data.draw(command_lines(world))
    check_command_line(capsys, monkeypatch, world, line.argv, line.must_refuse)


@pytest.mark.slow
@settings(max_examples=600, derandomize=True, **COMMON)
@given(data=st.data())
def test_every_drawn_command_line_is_answered_many(capsys, monkeypatch, world, data):
    line = data.draw(command_lines(world))
    check_command_line(capsys, monkeypatch, world, line.argv, line.must_refuse)


def test_the_fixture_world_is_usable(capsys, monkeypatch, world):
    """The stand-ins stop commands that are given good input (so the property reaches them), and the real run is
    read: status answers 0 for it."""
    with tempfile.TemporaryDirectory():
        for argv in (["status", world.run_id, "--json"], ["list"], ["logs", world.run_id]):
            check_command_line(capsys, monkeypatch, world, argv)
        started: list[str] = []
        with monkeypatch.context() as m:
            m.setenv("HPC_TOOLS_SLURM", "off")
            m.setenv("HPC_TOOLS_SITE", "none")
            m.setenv("HPC_TOOLS_RUNS_DIR", world.runs_root)
            m.chdir(world.scratch)
            stand_ins(m, started)
            code, _, err = run_one(capsys, ["generate", "127.0.0.1:1", "--prompt", "hi"])
        assert code is None and started == ["hpc_tools.serving.client.infer_many"], (code, err[-500:])
