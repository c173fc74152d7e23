"""Command lines for the CLI property (tests/unit/test_cli_args_space.py), drawn from the argparse parsers themselves.

Each command's subparser is walked (``parser_actions``): every positional and option becomes a draw from a pool
chosen by what the action is -- its ``type`` (a number: negative, zero, beyond 64 bits, nan, inf, not a number),
its ``choices`` (each valid one, and some that are not), a flag (there or not), ``--set`` (valid and broken
overrides), and by its destination (a run reference, a recipe, a folder to write, a folder to read, a HOST:PORT, free
text). The pools mix values that lead a command all the way (the fixture run, a shipped recipe with a sweep, a model
folder) with hostile ones: missing runs, a file where a folder is expected, a non-empty folder, quotes, newlines,
unicode, empty strings. A new option of any command is drawn from the day it is added.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from hypothesis import strategies as st

from hpc_tools.cli import build_parser

# The commands the property covers (issue 47): every command that takes arguments of its own and acts on runs, models
# or recipes.
COMMANDS = ("eval", "quantize", "serve", "generate", "export", "cancel", "preflight", "resume", "logs", "status",
            "list", "sweep", "report")

# (good, hostile) values of each kind: an example draws mostly good values, so that it reaches deep into a command,
# and a few hostile ones, so that each check on the way is met.
# Never a valid number for any option of these commands (all count, size, time, step or temperature): negative,
# not finite, beyond 64 bits, or not written as a plain decimal number. A line holding one must be refused.
NEVER_NUMBERS = ("-1", "9223372036854775808", "-9223372036854775809", "9" * 60, "nan", "inf", "-inf", "1e400",
                 "0x10", "", " ", "abc", "\u0663", "1_000")
NUMBERS = (("1", "2", "7"), NEVER_NUMBERS + ("0", "65536", "2147483648", "-0.0", "1.5"))
TEXT = (("x", "1,2,3", "1:00", "hellaswag"),
        ("", "a,b", "-1", "0:00", "2:30", "'\"$(id)`", "a\nb", "\u00fc\u4e2d\U0001f600", "x" * 300, "n[1-2]", " ",
         "\x00"))
SETS = (("training.train_iters=2", "cluster.time_limit=00:30:00"),
        ("parallel.tensor_size=3", "x", "a.b=c", "training.lr=nan", "=", "cluster.time_limit=soon",
         "training.fp8_recipe=tensorwise", "model.num_layers=" + "9" * 50, "local.training.train_iters=0"))
BAD_CHOICES = ("", "bogus", "LOCAL", "\n")


@dataclass(frozen=True)
class Places:
    """The fixture world the command lines point into (absolute paths, as text)."""

    run_id: str
    run_dir: str
    runs_root: str
    scratch: str
    model: str  # a Hugging Face folder (config.json only)
    a_file: str
    full_dir: str
    recipe: str  # a shipped recipe with a sweep: section
    plain_recipe: str  # a shipped recipe without one


def parser_actions(command: str) -> list[argparse.Action]:
    """The command's own actions (not -h)."""
    parser = build_parser(command, lazy=True)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [a for a in sub.choices[command]._actions if not isinstance(a, argparse._HelpAction)]


def run_refs(p: Places) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return ((p.run_id, p.run_id[:12], p.run_dir, p.model),
            ("no-such-run", "", p.a_file, p.full_dir, "..", "12345", "'; touch pwned", "a\nb", "\u00fcber", "-",
             p.run_dir + "/records"))


def out_paths(p: Places) -> tuple[tuple[str, ...], tuple[str, ...]]:
    base = Path(p.scratch)
    return ((str(base / "out"), str(base / "\u00fcnicode-\U0001f600"), str(base / "o'ut\"q")),
            (str(base / "o\nut"), p.full_dir, p.a_file, str(Path(p.a_file) / "under-a-file"), "", "/dev/null/x",
             p.run_dir))


def read_paths(p: Places) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return ((p.full_dir, p.model), (p.a_file, str(Path(p.scratch) / "missing"), "", "/dev/null", p.run_dir))


def runs_dirs(p: Places) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return ((p.runs_root,), (str(Path(p.scratch) / "new-root"), p.a_file, "", p.full_dir, "/dev/null/x"))


def recipes(p: Places) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return ((p.recipe, p.plain_recipe), (str(Path(p.scratch) / "missing.yaml"), p.a_file, p.full_dir, "", "\n"))


def endpoints(p: Places) -> tuple[tuple[str, ...], tuple[str, ...]]:
    good, bad = run_refs(p)
    return (good + ("127.0.0.1:1",), bad + ("localhost:99999", "[::1]:80", ":", "a:b", "host:-1", "http://x:1"))


def pool(action: argparse.Action, p: Places) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(good, hostile) values of one action (see the module doc)."""
    dest = action.dest
    if action.choices:
        return tuple(map(str, action.choices)), BAD_CHOICES
    table = {"overrides": lambda: SETS, "run": run_refs, "refs": run_refs, "endpoint": endpoints, "recipe": recipes,
             "runs_dir": runs_dirs, "out": out_paths, "file": read_paths, "include_path": read_paths,
             "calibration": read_paths}
    if dest in table:
        return table[dest](p) if dest != "overrides" else SETS
    if is_number(action):
        return NUMBERS
    return TEXT


@st.composite
def value(draw, values: tuple[tuple[str, ...], tuple[str, ...]], hostile: float) -> str:
    good, bad = values
    return draw(st.sampled_from(bad if draw(st.floats(0, 1)) < hostile else good))


def is_flag(action: argparse.Action) -> bool:
    return action.nargs == 0


@st.composite
def sweep_targets(draw, p: Places, hostile: float) -> list[str]:
    """sweep's TARGET words: a recipe, or status/rerun and a sweep reference (or a wrong count of words)."""
    form = draw(st.sampled_from(("recipe", "recipe", "status", "rerun", "words")))
    if form == "recipe":
        return [draw(value(recipes(p), hostile))]
    if form == "words":
        return draw(st.lists(st.sampled_from(TEXT[0] + TEXT[1] + ("status", "rerun")), min_size=1, max_size=3))
    return [form, *draw(st.lists(value(run_refs(p), hostile), min_size=0, max_size=2))]


@dataclass(frozen=True)
class Line:
    argv: list[str]
    must_refuse: str | None  # why the line is bad whatever the command does (an option's value no option takes)


def is_number(action: argparse.Action) -> bool:
    return action.type in (int, float) or getattr(action.type, "__name__", "").startswith(("whole number", "number"))


@st.composite
def command_lines(draw, p: Places, commands: tuple[str, ...] = COMMANDS) -> Line:
    """One command line: the command, then each of its actions drawn (options in a drawn order, positionals last,
    after ``--`` when a value starts with ``-``). ``hostile``, drawn per line, is the chance of each value being a
    hostile one: some lines are all good values (they get as far as the command goes), most have one or two bad."""
    command = draw(st.sampled_from(commands))
    hostile = draw(st.sampled_from((0.0, 0.1, 0.2, 0.5)))
    options: list[list[str]] = []
    positionals: list[str] = []
    must_refuse = None
    for action in parser_actions(command):
        if not action.option_strings:
            if command == "sweep" and action.dest == "target":
                positionals += draw(sweep_targets(p, hostile))
                continue
            if action.nargs == "?" and draw(st.booleans()):
                continue
            count = draw(st.integers(1, 2)) if action.nargs in ("+", "*") else 1
            if hostile and draw(st.integers(0, 19)) == 0:  # now and then a required positional is left out
                count = 0
            positionals += [draw(value(pool(action, p), hostile)) for _ in range(count)]
            continue
        flag = draw(st.sampled_from(action.option_strings))
        if is_flag(action):
            if draw(st.integers(0, 3)) == 0:
                options.append([flag])
            continue
        if action.required:
            times = 0 if hostile and draw(st.integers(0, 19)) == 0 else 1  # left out now and then
        else:
            times = draw(st.sampled_from((0, 0, 1, 2 if action.dest in ("overrides", "statuses") else 1)))
        for _ in range(times):
            options.append([flag, draw(value(pool(action, p), hostile))])
            if is_number(action) and options[-1][1] in NEVER_NUMBERS:
                must_refuse = must_refuse or f"{flag} {options[-1][1]!r} is no number an option takes"
            elif action.choices and options[-1][1] not in map(str, action.choices):
                must_refuse = must_refuse or f"{flag} {options[-1][1]!r} is not one of its choices"
    options = draw(st.permutations(options)) if options else options
    argv = [command] + [word for option in options for word in option]
    if any(v.startswith("-") for v in positionals):
        return Line(argv + ["--"] + positionals, must_refuse)
    return Line(argv + positionals, must_refuse)
