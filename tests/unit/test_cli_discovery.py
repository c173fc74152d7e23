"""Command discovery without importing every command: each module in hpc_tools/cli is reachable from --help, what
--help shows is what the module says, and --help imports no command module."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import hpc_tools.cli as cli
from tests.helpers import REPO

CLI_DIR = Path(cli.__file__).parent
MODULES = sorted(p.stem for p in CLI_DIR.glob("*.py") if not p.name.startswith("_"))


def test_every_command_module_is_reachable_from_help(capsys):
    """A module in hpc_tools/cli that defines NAME but does not show in --help (or whose own --help fails) fails
    here: a new command needs nothing but its module."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    top = capsys.readouterr().out
    assert exit_.value.code == 0
    commands = [importlib.import_module(f"hpc_tools.cli.{m}") for m in MODULES]
    commands = [mod for mod in commands if hasattr(mod, "NAME")]
    assert len(commands) >= 14, [m.__name__ for m in commands]
    for mod in commands:
        assert f"    {mod.NAME} " in top or f"    {mod.NAME}\n" in top, f"{mod.__name__} is not listed in --help"
        with pytest.raises(SystemExit) as exit_:
            cli.main([mod.NAME, "--help"])
        assert exit_.value.code == 0, mod.NAME
        assert f"usage: python -m hpc_tools {mod.NAME}" in capsys.readouterr().out


def test_the_specs_read_from_the_sources_match_the_modules():
    specs = {s.module: s for s in cli.command_specs()}
    for name in MODULES:
        mod = importlib.import_module(f"hpc_tools.cli.{name}")
        if not hasattr(mod, "NAME"):
            assert mod.__name__ not in specs
            continue
        spec = specs[mod.__name__]
        assert (spec.name, spec.help, spec.order) == (mod.NAME, mod.HELP, getattr(mod, "ORDER", 100))


def test_help_imports_no_command_module_nor_pydantic():
    code = ("import sys\nfrom hpc_tools.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('LOADED=' + ','.join(sorted(m for m in sys.modules if m.startswith('hpc_tools.cli.') or "
            "m.split('.')[0] in ('pydantic', 'yaml', 'jinja2', 'pandas', 'torch'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip().endswith("LOADED="), out.stdout[-400:]


def test_a_command_runs_with_only_its_own_module_imported():
    code = ("import sys\nfrom hpc_tools.cli import main\nmain(['validate', '--rules'])\n"
            "print('LOADED=' + ','.join(sorted(m for m in sys.modules if m.startswith('hpc_tools.cli.'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "LOADED=hpc_tools.cli._common,hpc_tools.cli.validate"


def test_discovery_reads_literals_imports_computed_names_and_skips_helpers(tmp_path, monkeypatch):
    pkg = tmp_path / "planted_cli"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "alpha.py").write_text('"""doc"""\nNAME = "alpha"\nHELP = "first " + "command"\nORDER = 5\n'
                                  "def add_arguments(p):\n    pass\nNAME = 'ignored after the first def'\n")
    (pkg / "beta.py").write_text('NAME = "be" + "ta".upper()\nHELP = str(len("x"))\nIMPORTED = True\n')
    (pkg / "gamma.py").write_text("def helper():\n    return 1\n")  # no NAME: not a command
    (pkg / "_private.py").write_text('NAME = "private"\nHELP = "x"\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    specs = cli.command_specs(pkg, "planted_cli")
    assert [(s.name, s.help, s.order) for s in specs] == [("alpha", "first command", 5), ("beTA", "1", 100)]
    assert "planted_cli.alpha" not in sys.modules, "a literal module must not be imported"
    assert "planted_cli.beta" in sys.modules, "a computed NAME is read by importing the module"


@pytest.mark.parametrize("argv,expected", [(["validate", "x.yaml"], "validate"), (["--version"], None),
                                           (["-h", "plan"], "plan"), (["nope"], None), ([], None)])
def test_selected_command(argv, expected):
    assert cli.selected_command(argv, {"validate", "plan"}) == expected


def test_status_of_a_run_reads_its_records_without_pandas(tmp_path):
    """The records scan behind `status` (stragglers, goodput) reads parquet through Arrow buffers, not
    ``Array.to_numpy``, which imports pandas (a third of a second on every status)."""
    import numpy as np

    from hpc_tools.testing.synthetic import synthetic_run

    synthetic_run(tmp_path, ["cluster.gpus_per_node=2"], np.full((2, 12), 0.1), state="RUNNING")
    code = ("import sys\nfrom hpc_tools.cli import main\nrc = main(['status', '--runs-dir', sys.argv[1]])\n"
            "print('RC=%d PANDAS=%s' % (rc, 'pandas' in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "RC=0 PANDAS=False", (out.stdout[-500:], out.stderr[-500:])
    assert "goodput" in out.stdout
