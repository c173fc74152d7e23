"""A property over the whole recipe space: whatever a recipe holds, every command that reads one answers in its own
terms -- exit 0, 1 (plan: does not fit) or 2 -- never with a traceback, writes nothing when it refuses (exit 2), and
every error line names a field.

The recipes are drawn from the schema's own types and bounds (``tests/unit/recipe_strategies.py``): each is a shipped
recipe with a few fields changed to valid, boundary, out-of-bound or wrongly typed values, deleted, or joined by
unknown keys, so that many pass the schema and reach the rules, the memory fit and the planner. The commands run in
this process (``hpc_tools.cli.main``); ``validate --offline`` consults no Slurm, so the property holds with or without
one. The fast tier draws a bounded, derandomized sample (the same examples every run); the slow tier many more.
"""

from __future__ import annotations

import re
import signal
import tempfile
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, Phase, example, given, note, settings

from hpc_tools.cli import main
from hpc_tools.recipe.fields import iter_paths, schema_path
from tests.unit.recipe_strategies import drawn_recipes, shipped_recipes

# CPU seconds (not wall: a busy machine stretches wall time, not the work done) for one command on one recipe; they
# take milliseconds to a few seconds (a search of a large MoE recipe). More is a hang, a defect of its own.
COMMAND_LIMIT_S = 60.0
SCHEMA_PATHS = {path for path, _ in iter_paths()}
PATH_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*(?:\.[A-Za-z0-9_-]+)*")
EXITS = {"validate": {0, 2}, "plan": {0, 1, 2}, "plan --search": {0, 1, 2}, "render": {0, 2}}


class CommandTimeout(Exception):
    pass


@contextmanager
def time_limit(seconds: float):
    """Raise CommandTimeout in this (the main) thread after ``seconds`` of CPU time of this process."""
    def expired(*_):
        raise CommandTimeout(f"still running after {seconds:.0f} s")

    previous = signal.signal(signal.SIGPROF, expired)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)


def run(capsys, argv: list[str]) -> tuple[int | str, str, str]:
    """(exit code, stdout, stderr) of ``hpc_tools.cli.main(argv)``; the exit code is the text of the traceback when
    the command raised anything (SystemExit included: main returns its status)."""
    capsys.readouterr()
    try:
        with time_limit(COMMAND_LIMIT_S):
            code: int | str = main(argv)
    except BaseException as exc:  # noqa: BLE001 -- any exception is the failure this test looks for
        if isinstance(exc, KeyboardInterrupt):
            raise
        code = "".join(traceback.format_exception(exc))[-3000:]
    out = capsys.readouterr()
    return code, out.out, out.err


def raw_paths(raw: Any, prefix: str = "") -> set[str]:
    """Every dotted key path written in the recipe mapping (``local.model.num_layers``, ``cluster.setup.env.X``)."""
    out = set()
    if isinstance(raw, dict):
        for key, value in raw.items():
            path = f"{prefix}{key}"
            out.add(path)
            out |= raw_paths(value, path + ".")
    return out


def names_a_field(line: str, recipe: str, written: set[str]) -> bool:
    """The error line's message starts with a field: a dotted path of the schema or a key path written in the
    recipe (after ``error: RECIPE[ (profile local)| (and its local profile)]: ``)."""
    message = line[len("error:"):].strip()
    if message.startswith(recipe):
        message = message[len(recipe):]
        message = re.sub(r"^ \((profile [a-z]+|and its local profile)\)", "", message).lstrip(":").strip()
    found = PATH_RE.match(message)
    if not found:
        return False
    path = found.group(0)
    return path in SCHEMA_PATHS or schema_path(path) != "recipe" or path in written or path.split(".")[0] in written


def check_recipe_space(capsys, case) -> None:
    name, raw, changes = case
    note(f"{name} with " + "; ".join(f"{kind} {'.'.join(path)}={value!r}" for kind, path, value in changes))
    written = raw_paths(raw)
    with tempfile.TemporaryDirectory() as tmp:
        recipe = str(Path(tmp) / name)
        Path(recipe).write_text(yaml.safe_dump(raw, sort_keys=False))
        out_dir = Path(tmp) / "out"
        out_dir.mkdir()
        commands = {"validate": ["validate", recipe, "--offline"], "plan": ["plan", recipe, "--no-calibration"],
                    "plan --search": ["plan", recipe, "--search", "--top", "1", "--losers", "1", "--no-calibration"],
                    "render": ["render", recipe, "--jobs-dir", str(out_dir)]}
        for command, argv in commands.items():
            before = sorted(p.relative_to(tmp) for p in Path(tmp).rglob("*"))
            t0 = time.perf_counter()
            code, out, err = run(capsys, argv)
            shown = code if isinstance(code, int) else 'traceback'
            note(f"{command}: exit {shown} in {time.perf_counter() - t0:.2f} s")
            assert isinstance(code, int), f"{command} raised:\n{code}"
            assert code in EXITS[command], f"{command} exited {code}:\n{out[-1500:]}\n{err[-1500:]}"
            errors = [ln for ln in (out + "\n" + err).splitlines() if ln.startswith("error:")]
            if code == 2:
                assert errors, f"{command} exited 2 without an error line:\n{out[-800:]}\n{err[-800:]}"
                assert sorted(p.relative_to(tmp) for p in Path(tmp).rglob("*")) == before, f"{command} wrote on exit 2"
            unnamed = [ln for ln in errors if not names_a_field(ln, recipe, written)]
            assert not unnamed, f"{command}: error lines naming no field: {unnamed[:3]}"
            assert "Traceback" not in out + err, f"{command} printed a traceback:\n{err[-2000:]}"
            if command == "render" and code == 2:
                assert not any(out_dir.iterdir()), "render wrote a job script on exit 2"


def issue_29_case():
    """The traceback issue 29 names: gpt_3d with a virtual pipeline, full recompute and a GPU too small (the memory
    fit's suggested deeper pipelines left a virtual chunk no layer: ZeroDivisionError in validate and plan)."""
    raw = shipped_recipes()["gpt_3d.yaml"]
    changes = [("valid", ("parallel", "virtual_pipeline_size"), 4),
               ("valid", ("training", "recompute_granularity"), "full"), ("valid", ("cluster", "gpu_mem_gb"), 4.0)]
    for _, (section, key), value in changes:
        raw[section][key] = value
    return "gpt_3d.yaml", raw, changes


# No database (nothing written into the repository); no explain phase (it traces every line: 10x slower).
COMMON = dict(deadline=None, database=None, print_blob=True,
              phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                     HealthCheck.data_too_large, HealthCheck.filter_too_much])


@settings(max_examples=60, derandomize=True, **COMMON)
@given(case=drawn_recipes())
@example(case=issue_29_case())
def test_every_drawn_recipe_is_answered_by_every_command(capsys, case):
    check_recipe_space(capsys, case)


@pytest.mark.slow
@settings(max_examples=200, derandomize=True, **COMMON)
@given(case=drawn_recipes(max_changes=6))
def test_every_drawn_recipe_is_answered_by_every_command_many(capsys, case):
    check_recipe_space(capsys, case)


def test_search_of_a_huge_global_batch_ends(capsys):
    # Found checking the search's speed for the property above: training.global_batch_size=2^40 (in bounds) made the
    # search count every integer up to 2^40 for the micro-batch divisors (COMMAND_LIMIT_S would stop it); it ends
    # now, in CPU seconds.
    from hpc_tools.planner.search import _divisors

    assert all(list(_divisors(n)) == [x for x in range(1, n + 1) if n % x == 0] for n in range(1, 500))
    code, out, err = run(capsys, ["plan", "recipes/gpt_3d.yaml", "--search", "--top", "1", "--losers", "0",
                                  "--no-calibration", "--set", f"training.global_batch_size={2**40}"])
    assert code == 0, (code, err[-500:])
    assert "Apply the best" in out
