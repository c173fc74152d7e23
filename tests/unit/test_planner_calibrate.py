"""Calibration from run folders: predicted vs measured, the efficiency fit per cluster, and its use by later plans.

The run folders are written the way jobs write them (resolved recipe.yaml via dump_resolved, step records through
profiling.records.RecordWriter); their step times come from the model at a known efficiency, which the fit recovers.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from hpc_tools.cli import main
from hpc_tools.planner import plan_recipe
from hpc_tools.planner.calibrate import calibrate, read_run
from hpc_tools.planner.efficiency import efficiency_for
from hpc_tools.planner.estimate import make_plan
from hpc_tools.recipe.load import dump_resolved, load_recipe
from profiling.records import RecordWriter
from profiling.schema import SCHEMA_VERSION
from tests.helpers import REPO


def write_run(root: Path, name: str, recipe, step_time_s: float, mem_bytes: int, steps: int = 8) -> Path:
    run = root / name
    (run / "records").mkdir(parents=True)
    (run / "recipe.yaml").write_text(dump_resolved(recipe))
    world = recipe.cluster.nodes * recipe.cluster.gpus_per_node
    tokens = (recipe.training.global_batch_size or 1) * recipe.model.seq_length
    for rank in range(2):  # two ranks are enough: the slowest rank of each step counts
        writer = RecordWriter(run / "records", rank)
        for step in range(1, steps + 1):
            slow = 10.0 if step <= recipe.profiling.warmup_steps else 1.0  # warm-up steps are excluded
            t = step_time_s * slow * (1.0 if rank == 0 else 0.99)
            writer.write({"schema_version": SCHEMA_VERSION, "run_id": name, "job_id": None, "restart": 0,
                          "rank": rank, "node": socket.gethostname(), "tp_rank": 0, "pp_rank": 0, "dp_rank": rank,
                          "step": step, "time": 1.7e9 + step, "step_time_s": t, "tokens": tokens,
                          "tokens_per_s": tokens / t, "tokens_per_s_per_gpu": tokens / t / world,
                          "mem_allocated_max_bytes": mem_bytes - rank})
        writer.close(compact=False)
    return run


@pytest.fixture()
def runs(tmp_path):
    h100_a = load_recipe(REPO / "recipes/gpt_3d.yaml")
    h100_b = load_recipe(REPO / "recipes/gpt_3d.yaml",
                         ["training.micro_batch_size=4", "parallel.virtual_pipeline_size=null"])
    a100 = load_recipe(REPO / "recipes/gpt_zero.yaml")
    truth = {"H100-SXM": 0.42, "A100-80GB": 0.55}
    out = []
    for name, r in (("h100-a", h100_a), ("h100-b", h100_b), ("a100", a100)):
        plan = make_plan(r, efficiency=truth[r.cluster.gpu_type])
        out.append(write_run(tmp_path / "runs", name, r, plan.time.total_s, mem_bytes=int(7.5e9)))
    return out, truth, tmp_path / "calibration.json"


def test_read_run_takes_median_of_slowest_rank_after_warmup(runs):
    dirs, _, _ = runs
    m = read_run(dirs[0])
    assert m.steps == 8 - m.recipe.profiling.warmup_steps
    plan = make_plan(m.recipe, efficiency=0.42)
    assert m.step_time_s == pytest.approx(plan.time.total_s)
    assert m.mem_allocated_max_bytes == int(7.5e9)


def test_fit_recovers_the_efficiency_per_cluster_and_stores_it(runs):
    dirs, truth, store = runs
    report = calibrate(dirs, store=store)
    assert set(report["fitted"]) == {"H100-SXM@gpu/megatron", "A100-80GB@gpu/deepspeed"}
    assert report["fitted"]["H100-SXM@gpu/megatron"]["efficiency"] == pytest.approx(truth["H100-SXM"], rel=1e-9)
    assert report["fitted"]["A100-80GB@gpu/deepspeed"]["efficiency"] == pytest.approx(truth["A100-80GB"], rel=1e-9)
    for row in report["runs"]:
        assert row["predicted_step_s_after_fit"] == pytest.approx(row["measured_step_s"], rel=1e-9)
        assert row["predicted_mem_allocated_bytes"] > 0
    stored = json.loads(store.read_text())
    assert stored["clusters"]["H100-SXM@gpu/megatron"]["runs"] == ["h100-a", "h100-b"]
    # later plans for that cluster and backend kind use it
    r = load_recipe(REPO / "recipes/gpt_3d.yaml")
    assert efficiency_for(r.cluster, "megatron", store)[0] == pytest.approx(0.42)
    plan = plan_recipe(r, calibration=store)
    assert plan.efficiency == pytest.approx(0.42) and "calibrated" in plan.efficiency_source
    assert plan_recipe(r, calibration=store, use_calibration=False).efficiency_source.startswith("default")
    # ... and never those of another kind: FSDP on the same cluster starts from its own default
    fsdp = load_recipe(REPO / "recipes/gpt_3d.yaml", ["backend.kind=fsdp", "parallel.tensor_size=1",
                                                      "parallel.pipeline_size=1", "parallel.virtual_pipeline_size=null",
                                                      "parallel.sequence_parallel=false"], check=False)
    assert efficiency_for(fsdp.cluster, "fsdp", store) is None
    other = plan_recipe(fsdp, calibration=store)
    assert other.efficiency != pytest.approx(0.42) and other.efficiency_source.startswith("default")


def test_cli_calibrate_then_plan(runs, capsys):
    dirs, truth, store = runs
    assert main(["plan", "--calibrate", *map(str, dirs), "--calibration", str(store), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fitted"]["H100-SXM@gpu/megatron"]["efficiency"] == pytest.approx(truth["H100-SXM"])
    assert main(["plan", str(REPO / "recipes/gpt_3d.yaml"), "--calibration", str(store), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["step_time"]["efficiency"] == pytest.approx(truth["H100-SXM"])


def test_not_a_run_folder_is_a_one_line_error(tmp_path, capsys):
    assert main(["plan", "--calibrate", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "recipe.yaml" in err[0]
