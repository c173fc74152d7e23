"""Uneven pipeline stages (parallel.num_layers_in_first/last_pipeline_stage): the split against Megatron-core's own
TransformerConfig validation and layer assignment as the oracle, the recipe rules, the planner per stage, the search.
"""

from __future__ import annotations

import itertools
import warnings

import pytest

from hpc_tools.errors import RecipeError
from hpc_tools.layout import ParallelLayout, pipeline_chunks, uneven_splits
from hpc_tools.planner import plan_recipe
from hpc_tools.planner.arch import arch_for, stage_layer_counts, stage_parameters, total_parameters
from hpc_tools.planner.knobs import Knobs
from hpc_tools.planner.memory import estimate_memory, stage_memory
from hpc_tools.planner.steptime import COMPUTE
from hpc_tools.recipe.load import resolve

BASE = {
    "name": "uneven",
    "model": {"family": "llama", "num_layers": 8, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64,
              "vocab_size": 512},
    "training": {"micro_batch_size": 1, "global_batch_size": 48, "precision": "bf16"},
    "backend": {"kind": "megatron"},
    "cluster": {"nodes": 1, "gpus_per_node": 12, "gpu_type": "H100-SXM"},
}
FIRST, LAST = "parallel.num_layers_in_first_pipeline_stage", "parallel.num_layers_in_last_pipeline_stage"


def recipe(*sets: str, **model):
    raw = {**BASE, "model": {**BASE["model"], **model}}
    return resolve(raw, list(sets), source="test")


def violations(*sets: str, **model) -> list[str]:
    try:
        recipe(*sets, **model)
    except RecipeError as e:
        return [str(v) for v in e.violations]
    return []


# --- Megatron-core as the oracle -------------------------------------------------------------------------------------

def megatron_split(layers: int, p: int, v: int | None, first: int | None, last: int | None):
    """What Megatron-core 0.16 builds: per stage, per chunk, the (0-based) layers; None where its config refuses the
    split, an assertion of get_num_layers_to_build fails, or a stage gets no layer (or a negative count)."""
    import torch
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = TransformerConfig(num_layers=layers, hidden_size=8, num_attention_heads=2,
                                       pipeline_model_parallel_size=p, virtual_pipeline_model_parallel_size=v,
                                       num_layers_in_first_pipeline_stage=first,
                                       num_layers_in_last_pipeline_stage=last, pipeline_dtype=torch.float32)
        out = []
        for rank in range(p):
            chunks = []
            for vp in range(v or 1):
                stage = vp if v else None
                n = get_num_layers_to_build(config, vp_stage=stage, pp_rank=rank)
                offset = get_transformer_layer_offset(config, vp_stage=stage, pp_rank=rank) if p > 1 else 0
                if n <= 0:
                    return None
                chunks.append(range(offset, offset + n))
            out.append(tuple(chunks))
    except (ValueError, AssertionError, ZeroDivisionError):
        return None
    built = sorted(i for stage in out for chunk in stage for i in chunk)
    return tuple(out) if built == list(range(layers)) else None


GRID = [(layers, p, v, first, last)
        for layers in range(1, 11) for p in (2, 3, 4) for v in (None, 2, 3)
        for first, last in itertools.product((None, 1, 2, 3, 4, 6), repeat=2)]


@pytest.mark.megatron
def test_the_split_is_megatron_cores_own():
    """Over 10 layer counts x PP 2-4 x VPP none/2/3 x every first/last in {null, 1, 2, 3, 4, 6}: a split is one
    ``pipeline_chunks`` accepts exactly when Megatron-core builds it (every layer once, no stage empty), and then
    each stage's chunks hold the layers Megatron-core gives them."""
    accepted = refused = 0
    for layers, p, v, first, last in GRID:
        want = megatron_split(layers, p, v, first, last)
        got = pipeline_chunks(layers, p, v or 1, first, last)
        assert got == want, (layers, p, v, first, last, got, want)
        accepted += got is not None
        refused += got is None
    assert accepted > 150 and refused > 1000  # both sides of the rule are exercised


@pytest.mark.megatron
def test_megatron_core_itself_accepts_splits_the_rules_refuse():
    """Why the oracle is 'builds', not 'validates': Megatron-core 0.16's TransformerConfig accepts a first and last
    stage longer than the model when a middle stage is left (its layer count goes negative), and a count on PP1."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    for p, first, last in ((3, 3, 3), (1, 4, None)):
        TransformerConfig(num_layers=4, hidden_size=8, num_attention_heads=2, pipeline_model_parallel_size=p,
                          num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
                          pipeline_dtype=torch.float32)
        assert pipeline_chunks(4, p, 1, first, last) is None
    assert violations("parallel.pipeline_size=3", f"{FIRST}=3", f"{LAST}=3", num_layers=4)
    assert violations("parallel.pipeline_size=1", f"{FIRST}=4", num_layers=4)


# --- the recipe's rules --------------------------------------------------------------------------------------------

RULE_GRID = [(layers, p, v, first, last) for layers in (5, 6, 7, 8) for p in (2, 3, 4) for v in (None, 2)
             for first, last in ((None, None), (1, None), (None, 2), (2, 2), (3, 1), (4, 4), (2, 6))]


@pytest.mark.parametrize("layers, p, v, first, last", RULE_GRID)
def test_rules_accept_exactly_the_splits_megatron_builds(layers, p, v, first, last):
    sets = [f"parallel.pipeline_size={p}", f"parallel.virtual_pipeline_size={'null' if v is None else v}",
            f"{FIRST}={'null' if first is None else first}", f"{LAST}={'null' if last is None else last}"]
    lines = violations(*sets, num_layers=layers)
    ok = pipeline_chunks(layers, p, v or 1, first, last) is not None
    if ok:
        assert lines == []
        return
    assert len(lines) == 1, lines  # one root cause, one line
    (line,) = lines
    if first is None and last is None:
        assert line.startswith(f"model.num_layers={layers} must be divisible")
    else:
        assert line.startswith("parallel.num_layers_in_"), line
    # a split the line proposes is one that validates
    if "try parallel.num_layers_in_" in line or "uneven stages: parallel." in line:
        tail = line.split("try ")[-1] if "try parallel." in line else line.split("uneven stages: ")[-1]
        proposed = [s.strip(" )") for s in tail.split(" and ")]
        fixed = [s for s in sets if not s.startswith((FIRST, LAST))] + proposed
        assert violations(*fixed, num_layers=layers) == [], (line, fixed)


def test_the_layer_rule_proposes_uneven_stages_where_pp_does_not_divide():
    (line,) = violations("parallel.pipeline_size=4", num_layers=7)
    assert "uneven stages: parallel.num_layers_in_first_pipeline_stage=1 and" in line


@pytest.mark.parametrize("kind, extra", [("deepspeed", []), ("fsdp", [])])
def test_backends_without_uneven_stages_refuse_them_in_one_line(kind, extra):
    lines = violations(f"backend.kind={kind}", f"{FIRST}=2", *extra)
    assert any(x.startswith(f"{FIRST}=2 is not available with backend.kind={kind}") for x in lines), lines
    assert sum("num_layers_in_" in x for x in lines) == 1, lines


def test_uneven_splits_are_valid_and_shorter_at_the_ends():
    for layers, p, v in itertools.product(range(2, 130), (2, 3, 4, 8, 16), (1, 2, 4)):
        for first, last in uneven_splits(layers, p, v):
            chunks = pipeline_chunks(layers, p, v, first, last)
            assert chunks is not None
            counts = [sum(len(c) for c in stage) for stage in chunks]
            assert max(counts[0], counts[-1]) <= max(counts)
    assert (3, 2) in uneven_splits(61, 16) and (7, 7) in uneven_splits(126, 16)  # DeepSeek-V3, Llama-3 405B


# --- the planner per stage -----------------------------------------------------------------------------------------

def test_stage_parameters_follow_the_split_and_add_up():
    r = recipe("parallel.pipeline_size=4", f"{FIRST}=1", f"{LAST}=1", num_layers=8)
    arch = arch_for(r)
    counts = [sum(stage_layer_counts(arch, 4, s, 1, 1, 1)) for s in range(4)]
    assert counts == [1, 3, 3, 1]
    assert sum(stage_parameters(arch, 1, 4, s, first=1, last=1) for s in range(4)) == total_parameters(arch)


@pytest.mark.parametrize("sets", [
    ["parallel.pipeline_size=4", f"{FIRST}=1", f"{LAST}=1"],  # middle stages longer than the first
    ["parallel.pipeline_size=4", f"{FIRST}=5"],  # the first much longer
    ["parallel.pipeline_size=3", f"{LAST}=4"],
    ["parallel.pipeline_size=4", f"{FIRST}=2", f"{LAST}=2", "parallel.virtual_pipeline_size=2",
     "training.global_batch_size=96"],
])
def test_the_planned_peak_is_the_largest_stage(sets):
    """Memory is planned on the first, last and the busiest middle stage; that peak is the largest of ALL stages."""
    r = recipe(*sets, "training.recompute_granularity=none", num_layers=8)
    arch, k = arch_for(r), Knobs.from_recipe(r)
    every = [stage_memory(arch, k, s).total for s in range(k.layout.pipeline_size)]
    assert estimate_memory(arch, k).total == pytest.approx(max(every))


def test_a_shorter_first_stage_holds_less_and_a_middle_stage_is_planned():
    even = recipe("parallel.pipeline_size=4", num_layers=12)
    uneven = recipe("parallel.pipeline_size=4", f"{FIRST}=2", f"{LAST}=2", num_layers=12)  # 2 + 4 + 4 + 2
    pe, pu = plan_recipe(even, use_calibration=False), plan_recipe(uneven, use_calibration=False)
    assert pu.memory.stages[0].params < pe.memory.stages[0].params
    assert [st.stage for st in pu.memory.stages] == [0, 1, 3]


def test_step_time_runs_at_the_longest_stage():
    """Same FLOPs, PP4: 24 layers as 6 x 4 or as 3 + 9 + 9 + 3: the compute term grows by 9 / 6."""
    even = recipe("parallel.pipeline_size=4", num_layers=24)
    uneven = recipe("parallel.pipeline_size=4", f"{FIRST}=3", f"{LAST}=3", num_layers=24)
    te = plan_recipe(even, use_calibration=False).time.terms[COMPUTE]
    tu = plan_recipe(uneven, use_calibration=False).time.terms[COMPUTE]
    assert tu / te == pytest.approx(9 / 6)


def test_the_layout_says_the_split():
    lay = ParallelLayout.from_recipe(recipe("parallel.pipeline_size=4", f"{FIRST}=1", f"{LAST}=1", num_layers=8))
    assert "PP4(first 1, last 1)" in lay.describe()


# --- the search ----------------------------------------------------------------------------------------------------

def test_search_tries_uneven_stages_where_pp_does_not_divide_and_rows_apply():
    from hpc_tools.planner.search import enumerate_knobs, search

    # 7 layers on 12 GPUs: PP1 (PP7 does not divide 12); PP2, 3 and 4 only with shorter end stages (4 + 3, 2 + 3 + 2,
    # 1 + 2 + 2 + 2, ...); PP6 not at all (its middle stages would be shorter than an end)
    r = recipe(num_layers=7)
    seen = {(k.layout.pipeline_size, k.layout.first_stage_layers, k.layout.last_stage_layers)
            for k in enumerate_knobs(r, Knobs.from_recipe(r))}
    assert {p for p, first, last in seen if first is not None or last is not None} == {2, 3, 4}
    assert {p for p, first, last in seen if first is None and last is None} == {1}
    assert all(pipeline_chunks(7, p, 1, f, la) is not None for p, f, la in seen)
    result = search(recipe(num_layers=7, seq_length=64), top=20, use_calibration=False)
    rows = [c for c in result.ranked if c.knobs.layout.uneven]
    assert rows
    for c in rows[:3]:
        sets = c.knobs.overrides()
        assert any(s.startswith(FIRST) or s.startswith(LAST) for s in sets)
        again = Knobs.from_recipe(recipe(*sets, num_layers=7))
        assert again.layout == c.knobs.layout
