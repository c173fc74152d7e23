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


# --- the help says what the code does: asserted against the code's own lists ------------------------------------------

def _help(command: str) -> str:
    """``python -m hpc_tools COMMAND --help`` as built by the CLI, whitespace-normalised (argparse wraps lines)."""
    parser = dict(_commands())[command]
    return " ".join(parser.format_help().split())


def _varied(knobs) -> set[str]:
    """The Knobs attributes (``layout.X`` for the layout's) that take more than one value across ``knobs``."""
    import dataclasses

    seen: dict[str, set] = {}
    for k in knobs:
        for f in dataclasses.fields(k):
            value = getattr(k, f.name)
            items = ({f"{f.name}.{g.name}": getattr(value, g.name) for g in dataclasses.fields(value)}
                     if f.name in ("layout", "sharding") else {f.name: value})
            for name, v in items.items():
                seen.setdefault(name, set()).add(tuple(v) if isinstance(v, list) else v)
    return {name for name, values in seen.items() if len(values) > 1}


def test_plan_search_help_names_every_dimension_the_search_turns():
    from hpc_tools import backends
    from hpc_tools.planner.dimensions import DIMENSIONS
    from hpc_tools.planner.knobs import Knobs
    from hpc_tools.planner.search import enumerate_knobs
    from hpc_tools.recipe.load import load_recipe
    from tests.helpers import REPO

    text = _help("plan")
    for label, _ in DIMENSIONS:
        assert label in text, label
    named = {attr for _, attrs in DIMENSIONS for attr in attrs}
    turned: set[str] = set()
    for path in sorted((REPO / "recipes").glob("*.yaml")):
        recipe = load_recipe(path, check=False)
        if backends.of(recipe).trains_model:
            varied = _varied(enumerate_knobs(recipe, Knobs.from_recipe(recipe)))
            assert varied <= named, (path.name, sorted(varied - named))  # turned by the search, not in the help
            turned |= varied
    assert turned == named, sorted(named - turned)  # named in the help, turned by no shipped recipe's search


def test_export_help_names_every_backend_with_an_exporter():
    from hpc_tools import backends
    from hpc_tools.cli import command_specs

    kinds = backends.with_feature("hf_export")
    assert len(kinds) >= 3
    listed = next(s.help for s in command_specs() if s.name == "export")  # the top-level --help line
    text = _help("export")
    for kind in kinds:
        assert kind in listed and kind in text, kind


def test_explain_types_are_words_not_python_annotations():
    from hpc_tools.recipe.explain import explain
    from hpc_tools.recipe.fields import leaf_paths

    for path in leaf_paths():
        shown = explain(path)["type"]
        assert not any(bit in shown for bit in ("Annotated", "typing", "<class", "[", "constrained")), (path, shown)
    assert explain("model.moe_layer_freq")["type"] == \
        "integer (> 0, <= 100000) or list of 0/1 (at most 100000 items)"
