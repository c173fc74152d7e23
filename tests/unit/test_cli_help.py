"""Every command's --help renders (argparse expands '%' in help texts: a stray one crashes --help)."""

import pytest

from hpc_tools.cli import build_parser


def _commands():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return sorted(sub.choices.items())


@pytest.mark.parametrize("name,parser", _commands(), ids=[n for n, _ in _commands()])
def test_help_renders(name, parser):
    text = parser.format_help()
    assert name in text and "usage:" in text


def test_top_level_help_renders():
    assert "COMMAND" in build_parser().format_help()
