"""A plan that does not fit names the published memory savings it does not model (issue 29: DeepSeek-V3 and
Llama 3 405B with their authors' recomputation choices)."""

from __future__ import annotations

import json

import pytest

from hpc_tools.cli import main
from hpc_tools.planner.unmodelled import BF16_MOMENTS, EARLY_FREE, FP8_ACTIVATIONS
from tests.helpers import REPO

NO_CAL = ["--calibration", "/nonexistent/calibration.json"]
DEEPSEEK_AS_PUBLISHED = ["--set", "training.recompute_granularity=selective",
                         "--set", "training.recompute_modules=[layernorm, mla_up_proj]"]
LLAMA_AS_PUBLISHED = ["--set", "training.recompute_granularity=none"]


@pytest.mark.parametrize("recipe, sets, expected", [
    ("deepseek_v3", DEEPSEEK_AS_PUBLISHED, [EARLY_FREE, BF16_MOMENTS, FP8_ACTIVATIONS]),
    ("llama3_405b", LLAMA_AS_PUBLISHED, [EARLY_FREE, BF16_MOMENTS]),
])
def test_the_authors_recompute_choice_names_what_is_not_modelled(capsys, recipe, sets, expected):
    path = str(REPO / f"recipes/{recipe}.yaml")
    code = main(["plan", path, *sets, "--json", *NO_CAL])
    d = json.loads(capsys.readouterr().out)
    assert d["memory_not_modelled"] == expected
    if d["fits"]:  # fits as published: nothing to name
        assert code == 0
        return
    assert code == 1
    assert main(["plan", path, *sets, *NO_CAL]) == 1
    text = " ".join(capsys.readouterr().out.split())
    assert "Not modelled" in text and "arXiv 2412.19437" in text


def test_a_plan_that_fits_prints_no_such_line(capsys):
    path = str(REPO / "recipes/deepseek_v3.yaml")  # shipped with full recomputation: fits
    assert main(["plan", path, *NO_CAL]) == 0
    out = capsys.readouterr().out
    assert "FITS" in out and "Not modelled" not in out
