"""`analyze RUN --breakdown` on real local runs (the rank program, gloo, the real collectors' sampled traces):

- Megatron-core gpt_3d as TP2 x PP2 on 4 CPU ranks, every rank sleeping 0.1 s in its data loading
  (``HPC_TOOLS_TEST_SLOW_RANK='*:data:0.1'``): every rank's data bucket is 0.1 s per step, its buckets add up to
  its measured step, and the bubble matches the planner's bubble term and the collectors' pipeline wait.
- The same with rank 3 also spinning 0.2 s per step (``3:compute:0.2``): its compute grows by 0.2 s, its tensor
  peer (rank 2) waits 0.2 s more in comm.tp, its pipeline peer (rank 1) 0.2 s more in the pipeline, and the verdict
  names rank 3.
- FSDP and DeepSpeed ZeRO-3 on 2 ranks: the breakdown exists and adds up for other backends; their collectives are
  data-parallel.

One launch per configuration (module scope); every step after the warm-up traced (steps 3-9), and the figures
compared are each rank's median over them: on a loaded 2-core machine a single step's compute varies by 2x. The
``analyze`` and ``report`` commands, which only read the run folder, run in this process (``hpc_tools.cli.main``: the
same code, without a process start that imports pandas and matplotlib again).
"""

from __future__ import annotations

import json
from pathlib import Path
from statistics import median

import pytest

from hpc_tools.executors.local import run_local
from hpc_tools.layout import ParallelLayout
from hpc_tools.recipe.load import load_recipe
from hpc_tools.submission import new_run
from profiling.collector import SLOW_RANK_ENV
from tests.helpers import REPO, in_process

pytestmark = [pytest.mark.slow]
GPT = REPO / "recipes" / "gpt_3d.yaml"
FSDP = REPO / "recipes" / "llama_fsdp.yaml"
ZERO = REPO / "recipes" / "gpt_zero.yaml"
# one explicit window over steps 3-9 on every rank: sampled one-step windows would each be written out between
# steps, and a rank still writing its trace starts the next step late (its peers wait for it inside theirs)
TRACED = ["training.train_iters=9", "profiling.trace_sample_interval=0", "profiling.warmup_steps=2",
          "profiling.torch_profiler.enabled=true", "profiling.torch_profiler.start_step=3",
          "profiling.torch_profiler.num_steps=7", "profiling.torch_profiler.ranks=[0,1,2,3]",
          "checkpoint.interval_iters=100", "training.eval_interval=100"]
DATA_S, COMPUTE_S = 0.1, 0.2


def breakdown(run_dir: Path) -> dict:
    out = in_process("analyze", str(run_dir), "--breakdown", "--json")
    text = in_process("analyze", str(run_dir), "--breakdown")
    return {"json": json.loads(out), "text": text, "run": str(run_dir)}


def launch(root: Path, recipe_path: Path, overrides: list[str], slow: str) -> dict:
    recipe = load_recipe(recipe_path, TRACED + overrides, profile="local")
    run = new_run(recipe, root, "local", source=str(recipe_path))
    world = ParallelLayout.from_recipe(recipe).world_size
    assert run_local(run, world, extra_env={SLOW_RANK_ENV: slow}) == 0, (run.logs_dir / "rank00000.out").read_text()
    return breakdown(run.path)


@pytest.fixture(scope="module")
def gpt_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("breakdown")
    return {"data": launch(root / "data", GPT, [], f"*:data:{DATA_S}"),
            "slow": launch(root / "slow", GPT, [], f"*:data:{DATA_S},3:compute:{COMPUTE_S}")}


def by_rank(result: dict) -> dict[int, dict]:
    return {r["rank"]: r for r in result["json"]["ranks"]}


def med(result: dict, rank: int, *buckets: str) -> float:
    """The median over the traced steps of ``rank``'s sum of ``buckets``."""
    steps = by_rank(result)[rank]["steps"]
    return median(sum(s["buckets"].get(b, 0.0) for b in buckets) for s in steps)


@pytest.mark.megatron
def test_data_bucket_and_sum_on_every_rank(gpt_runs):
    result = gpt_runs["data"]
    ranks = by_rank(result)
    print("\n" + result["text"])
    assert sorted(ranks) == [0, 1, 2, 3]
    for rank, r in ranks.items():
        assert r["traced_steps"] == list(range(3, 10)), r
        # the median step's data bucket is the injected wait (the mean is not: on a loaded host one step's sleep
        # can be woken hundreds of ms late, measured 0.31 s for a 0.1 s sleep in a CI run)
        assert med(result, rank, "data") == pytest.approx(DATA_S, rel=0.2), (rank, r["steps"])
        assert r["sum_s"] == pytest.approx(r["step_s"], rel=0.05), (rank, r)
        for s in r["steps"]:  # a sleep never ends early; a loaded host wakes it late
            assert s["buckets"]["data"] >= DATA_S, (rank, s)
            assert sum(s["buckets"].values()) == pytest.approx(s["step_s"], rel=0.05), (rank, s)
        assert r["buckets"]["compute"] > 0 and r["buckets"]["comm.tp"] > 0, r["buckets"]
        assert set(r["buckets"]) >= {"compute", "comm.tp", "comm.pp", "comm.dp", "bubble", "data", "host", "other"}
    js = result["json"]
    assert set(js) >= {"ranks", "planned", "verdict", "ratio"} and js["verdict"]


@pytest.mark.megatron
def test_bubble_matches_the_plan_and_the_collectors(gpt_runs):
    """The bubbles ``analyze --breakdown`` shows, each rank's median over the traced steps, mean over the ranks: the
    breakdown's (waits in the schedule's fill and drain, the last stage's wait for the drain after its backwards
    included), the plan's (Megatron-core's schedule played on each stage's traced work: the last stage also holds the
    logits and the loss, so the stages are not equal), and the collectors' pp_wait_s (every p2p wait, the steady
    state's too), which the breakdown reads from the trace as well (``breakdown_p2p``)."""
    fig = gpt_runs["data"]["json"]["bubble"]
    print("\n" + gpt_runs["data"]["text"].split("plan: ", 1)[1])
    # Within 25 % of the plan at a moderate load (0.89-1.05 in three runs at load 15-28), but not on every run of a
    # 2-core host that runs four ranks beside another test: a rank's fill and drain waits also hold the time the host
    # gave the other stage (0.74 in a CI run, 1.67 at the load's peak). So the test holds the bubble to the plan's
    # order (a factor of 2) and prints the ratio; the per-phase split itself is held exactly by the synthetic
    # timelines of tests/unit/test_breakdown_phases.py.
    ratio = fig["breakdown"] / fig["planned"]
    print(f"bubble / plan: {ratio:.2f}")
    assert 0.5 <= ratio <= 2.0, fig
    # every p2p wait the collectors saw is in the trace (bubble or comm.pp): within 1 % in the runs measured
    assert fig["breakdown_p2p"] == pytest.approx(fig["collectors"], rel=0.1), fig
    # The bubble vs the collectors' figure: they differ by the steady state's waits (comm.pp here, in pp_wait_s) and
    # the last stage's wait for the drain (in a cross-stage collective, not in p2p): 0.54-0.85 of it in four runs on
    # a 2-core host at a load average of 15-28, where the other stage's scheduling delays fill the steady state
    print(f"bubble / collectors' pp_wait_s: {fig['breakdown'] / fig['collectors']:.2f}")


@pytest.mark.megatron
def test_slow_compute_shows_on_the_rank_and_on_its_peers(gpt_runs):
    """Rank 3 (tp_rank 1 of stage 1) spins 0.2 s per step: its compute stands 0.2 s above the other ranks', it is
    named, and its tensor peer (rank 2) waits for it: that pair's steps are the same length, so what rank 3 computes
    longer rank 2 waits, and the breakdown must put it in a wait bucket. Which one is the host's timing: rank 2 waits
    in comm.tp when stage 0's activations reach it before rank 3 is done (measured so in most runs); when rank 1's
    send to the spinning rank 3 holds stage 0 back, rank 2 waits for rank 0's activations (comm.pp or the bubble, a
    CI run: comm.tp +0.016 s for a compute gap of 0.22 s). (How much longer the step gets depends on the host: on an
    oversubscribed one the spin takes a core the others were waiting for.)"""
    data, slow = by_rank(gpt_runs["data"]), by_rank(gpt_runs["slow"])
    print("\n" + gpt_runs["slow"]["text"])
    assert (slow[2]["tp_rank"], slow[2]["pp_rank"], slow[1]["tp_rank"], slow[1]["pp_rank"]) == (0, 1, 1, 0)
    excess = {name: med(run, 3, "compute") - median(med(run, r, "compute") for r in (0, 1, 2))
              for name, run in gpt_runs.items()}
    assert excess["slow"] == pytest.approx(COMPUTE_S, rel=0.5) and abs(excess["data"]) < COMPUTE_S / 2, excess
    waits = ("comm.tp", "comm.pp", "bubble")
    pair = {name: (med(run, 2, *waits) - med(run, 3, *waits), med(run, 3, "compute") - med(run, 2, "compute"),
                   {b: round(med(run, 2, b) - med(run, 3, b), 4) for b in waits})
            for name, run in gpt_runs.items()}
    wait, compute_gap, split = pair["slow"]
    print(f"rank 2's waits over rank 3's: {wait:.3f} s for a compute gap of {compute_gap:.3f} s ({split})")
    assert wait > 0.5 * compute_gap > 0.5 * COMPUTE_S / 2, pair
    js = gpt_runs["slow"]["json"]
    assert js["straggler"]["rank"] == 3
    assert {(w["rank"], w["group"]) for w in js["straggler"]["waiting"]} == {(2, "tp"), (1, "pp")}
    assert "Rank 3's compute is the longest" in js["verdict"]
    assert data[3]["buckets"]["compute"] < slow[3]["buckets"]["compute"]


@pytest.mark.megatron
def test_report_has_the_section_and_the_waterfall(gpt_runs, tmp_path):
    in_process("report", gpt_runs["data"]["run"], "--out", str(tmp_path))
    md = (tmp_path / "report.md").read_text()
    section = md.split("## Where the step went", 1)[1].split("\n## ", 1)[0]
    assert "| plan |" in section and "Verdict: " + gpt_runs["data"]["json"]["verdict"] in section
    assert (tmp_path / "step_waterfall.png").stat().st_size > 0 and "step_waterfall" in md
    assert "Where the step went" in (tmp_path / "report.html").read_text()


@pytest.mark.parametrize("recipe", [pytest.param(FSDP, id="fsdp"),
                                    pytest.param(ZERO, id="deepspeed", marks=pytest.mark.deepspeed)])
def test_other_backends_add_up(tmp_path_factory, recipe):
    result = launch(tmp_path_factory.mktemp(recipe.stem), recipe,
                    ["cluster.gpus_per_node=2", "profiling.torch_profiler.ranks=[0,1]"], f"*:data:{DATA_S}")
    print("\n" + result["text"])
    for rank, r in by_rank(result).items():
        assert r["sum_s"] == pytest.approx(r["step_s"], rel=0.05), (rank, r)
        assert med(result, rank, "data") == pytest.approx(DATA_S, rel=0.2), (rank, r["steps"])  # see above
        assert min(s["buckets"]["data"] for s in r["steps"]) >= DATA_S, (rank, r["steps"])
        assert r["buckets"]["comm.dp"] > 0, r["buckets"]  # all-gathers and reduce-scatters: the dp group
        assert r["buckets"]["comm.dp"] > 5 * r["buckets"]["other"], r["buckets"]  # assigned, not left unknown
