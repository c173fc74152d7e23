"""Post-save step inflation (issue 48 item 4) on a real async-save run: Megatron-core gpt_3d's local profile as DP2 on
2 CPU ranks through the real entry point, one launch, a background (``checkpoint.async_save``) save every EVERY steps
and the synchronous last one; a torch.profiler window on rank 0 so that ``analyze --breakdown`` has a trace.

``status --json`` (``post_save``), its text, the report's goodput section and ``analyze --breakdown`` each give the
steps after every save against the steady median; the figures must be those of the run's own step records (the first
step after each save over the steady median; the inflated steps counted while longer than the threshold). The
figures are printed with -s.
"""

from __future__ import annotations

import json

import pytest

from hpc_tools.executors.local import run_local
from hpc_tools.layout import ParallelLayout
from hpc_tools.recipe.load import load_recipe
from hpc_tools.submission import new_run
from profiling import post_save
from tests.helpers import REPO, run_cli, step_records

ITERS, EVERY = 24, 6
SETS = [f"training.train_iters={ITERS}", f"checkpoint.interval_iters={EVERY}", "checkpoint.async_save=true",
        "checkpoint.keep_last=2", "training.eval_interval=100", "training.log_interval=6",
        "parallel.tensor_size=1", "parallel.sequence_parallel=false", "parallel.pipeline_size=1",
        "cluster.gpus_per_node=2", "profiling.warmup_steps=2", "profiling.trace_sample_interval=0",
        "profiling.torch_profiler.enabled=true", "profiling.torch_profiler.start_step=3",
        "profiling.torch_profiler.num_steps=2", "profiling.torch_profiler.ranks=[0]"]

pytestmark = [pytest.mark.slow, pytest.mark.megatron]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    recipe = load_recipe(REPO / "recipes" / "gpt_3d.yaml", SETS, profile="local")
    r = new_run(recipe, tmp_path_factory.mktemp("post-save"), "local", source="gpt_3d.yaml")
    code = run_local(r, ParallelLayout.from_recipe(recipe).world_size, extra_env={"PYTHONPATH": str(REPO)})
    assert code == 0, (r.logs_dir / "rank00000.out").read_text(errors="replace")[-4000:]
    status = run_cli("status", str(r.path), "--json")
    assert status.returncode == 0, status.stderr[-2000:]
    p = json.loads(status.stdout)["post_save"]
    for s in p["per_save"]:
        print(f"\nsave of step {s['step']} ({'async' if s['async'] else 'sync'}): {s['steps']} inflated step(s), "
              f"first step after it {s['first_ratio']}x the steady {p['steady_median_s']:.4f} s, "
              f"extra {s['extra_s']:.3f} s")
    return r, p


def test_status_gives_each_saves_next_steps_against_the_steady_median(run):
    r, p = run
    assert [(s["step"], s["async"]) for s in p["per_save"]] == [(6, True), (12, True), (18, True), (24, False)]
    times = {rec["step"]: rec["step_time_s"] for rec in step_records(r.path)[0]}
    median = p["steady_median_s"]
    measured = [t for s, t in times.items() if s > 2]
    assert min(measured) <= median <= max(measured)
    for s in p["per_save"][:3]:
        assert s["first_ratio"] == pytest.approx(times[s["step"] + 1] / median), s
        run_of = 0
        while s["step"] + run_of + 1 <= ITERS and times[s["step"] + run_of + 1] > p["threshold"] * median:
            run_of += 1
        assert s["steps"] == min(run_of, EVERY), (s, times)
    assert p["per_save"][3]["first_ratio"] is None  # nothing trained after the last save
    assert p["saves"] == 4 and p["async"]["saves"] == 3 and p["sync"]["saves"] == 1
    text = run_cli("status", str(r.path))
    assert text.returncode == 0 and f"after saves {post_save.text(p)}" in text.stdout, text.stdout


def test_the_report_and_the_breakdown_show_it(run, tmp_path):
    r, p = run
    out = run_cli("report", str(r.path), "--out", str(tmp_path / "report"))
    assert out.returncode == 0, out.stderr[-2000:]
    md = (tmp_path / "report" / "report.md").read_text()
    goodput = md.split("## Goodput", 1)[1].split("\n## ", 1)[0]
    assert "post_save_saves" in goodput and "post_save_max_ratio" in goodput, goodput
    row = next(line for line in goodput.splitlines() if "post_save_saves" in line)
    cells = [c.strip() for c in row.split("|")]
    values = next(line for line in goodput.splitlines()[goodput.splitlines().index(row) + 2:] if line.strip())
    assert [c.strip() for c in values.split("|")][cells.index("post_save_saves")] == "4", (row, values)
    text = run_cli("analyze", str(r.path), "--breakdown")
    assert text.returncode == 0, text.stderr[-2000:]
    assert f"after saves: {post_save.text(p)}" in text.stdout, text.stdout
    js = json.loads(run_cli("analyze", str(r.path), "--breakdown", "--json").stdout)
    [b] = js if isinstance(js, list) else [js]
    assert b["post_save"]["per_save"] == p["per_save"]
