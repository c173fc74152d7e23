"""The measured layout search for real: `plan --search --measure 2` runs the planner's top 2 layouts of the tiny GPT
(gpt_3d's local profile, 4 CPU ranks, Megatron-core) for a few steps each, locally one after another, and on the
2-node Slurm test cluster as one job array, where `submit --auto --measure 2` then submits the winner (two
candidates rank as well as three; each one more costs the suite a 4-rank Megatron start on each path).

Checked: every candidate ran, the printed ranking follows the measured step times (recomputed from the runs' records
through profiling.figures), predicted and measured step times are both shown, the calibration file changed, and the
submitted run has the winner's layout.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from hpc_tools.planner.calibrate import read_run
from hpc_tools.planner.knobs import Knobs
from hpc_tools.recipe.load import load_recipe
from tests.helpers import REPO, run_cli

RECIPE = str(REPO / "recipes/gpt_3d.yaml")
K = 2
STEPS = 3  # measured steps per candidate, after the recipe's warm-up steps


KEY = "cpu/megatron+sdpa"  # CPU ranks; the local profile's Megatron layers are local, with the sdpa attention path


def seed_calibration(path: Path) -> dict:
    """A stored efficiency for CPU ranks that the search must start from and the measurement must replace."""
    data = {"version": 2, "clusters": {KEY: {"efficiency": 0.5, "runs": ["seed"], "fitted": "2026-01-01"}}}
    path.write_text(json.dumps(data))
    return data


def table_rows(text: str) -> list[list[str]]:
    """The measured-ranking table's rows (rich draws columns with │), as stripped cells."""
    return [[c.strip() for c in line.split("│")] for line in text.splitlines()
            if "│" in line and line.split("│")[0].strip() in {"-", *map(str, range(1, 10))}]


@pytest.mark.megatron
def test_measured_search_locally(tmp_path):
    cal = tmp_path / "calibration.json"
    before = seed_calibration(cal)
    out = run_cli("plan", RECIPE, "--search", "--measure", str(K), "--measure-steps", str(STEPS), "--executor", "local",
                  "--runs-dir", str(tmp_path / "runs"), "--calibration", str(cal), timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = table_rows(out.stdout)
    assert len(rows) == K, out.stdout
    # Ranked 1..K by measured step time, every candidate completed, predicted and measured both shown.
    assert [r[0] for r in rows] == [str(i) for i in range(1, K + 1)]
    assert sorted(r[1] for r in rows) == [str(i) for i in range(1, K + 1)]
    measured = [float(r[2]) for r in rows]
    assert measured == sorted(measured) and all(t > 0 for t in measured)
    assert all(float(r[3]) > 0 and r[7] == "completed" for r in rows)

    # Each run measured warm-up + STEPS steps, and the table shows what profiling.figures reads from its records.
    sweep = Path(out.stdout.split("runs: ")[-1].split()[0])
    cells = json.loads((sweep / "sweep.json").read_text())["cells"]
    assert len(cells) == K and {c["status"] for c in cells} == {"completed"}
    local = load_recipe(RECIPE, profile="local")
    by_config = {}
    for c in cells:
        m = read_run(sweep / c["run_dir"])
        assert m.steps == STEPS and m.recipe.training.train_iters == local.profiling.warmup_steps + STEPS
        by_config[Knobs.from_recipe(m.recipe).describe()] = m.step_time_s
    assert {r[8]: float(r[2]) for r in rows} == pytest.approx(by_config, abs=6e-5)  # printed with 4 decimals

    # The search started from the stored efficiency; the fitted one replaced it.
    assert f"efficiency 0.5 (calibrated {KEY}, 1 run(s)) ->" in out.stdout
    after = json.loads(cal.read_text())
    assert after != before and after["clusters"][KEY]["efficiency"] != 0.5
    assert sorted(after["clusters"][KEY]["runs"]) == sorted(c["run_dir"] for c in cells)


@pytest.mark.slurm
@pytest.mark.multinode
@pytest.mark.megatron
def test_submit_auto_measure_on_slurm_submits_the_winner(slurm_multinode, tmp_path):
    cal = tmp_path / "calibration.json"
    before = seed_calibration(cal)
    jobs: list[str] = []
    try:
        # 2 nodes x 2 CPU ranks; exclusive nodes make the array run one candidate at a time (honest timings).
        out = run_cli("submit", RECIPE, "--auto", "--measure", str(K), "--measure-steps", str(STEPS),
                      "--executor", "slurm", "--profile", "local", "--set", "cluster.nodes=2",
                      "--set", "cluster.gpus_per_node=2", "--set", "cluster.exclusive=true",
                      "--runs-dir", str(tmp_path / "runs"), "--json", env={"HPC_TOOLS_CALIBRATION": str(cal)},
                      timeout=900)
        data = json.loads(out.stdout) if out.stdout.strip().startswith("{") else {}
        jobs += [c["job_id"] for c in data.get("measure", {}).get("candidates", []) if c.get("job_id")]
        jobs += [data["job_id"]] if data.get("job_id") else []
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        report = data["measure"]
        cands = report["candidates"]
        assert report["executor"] == "slurm" and len(cands) == K and report["measured"] == K
        # One job array: every candidate is a task of the same job.
        assert len({c["job_id"].split("_")[0] for c in cands}) == 1 and all("_" in c["job_id"] for c in cands)
        times = [c["measured_step_s"] for c in cands]
        assert times == sorted(times) and all(c["predicted_step_s"] > 0 for c in cands)
        for c in cands:
            m = read_run(c["run_dir"])
            assert m.steps == STEPS and m.step_time_s == pytest.approx(c["measured_step_s"])
            assert m.recipe.cluster.nodes == 2 and len(list(Path(c["run_dir"], "records").glob("rank*"))) >= 4
        after = json.loads(cal.read_text())
        assert after != before and sorted(after["clusters"][KEY]["runs"]) == \
            sorted(Path(c["run_dir"]).name for c in cands)

        # The submitted job runs the winner's layout, with the recipe's own length.
        winner = report["winner"]
        assert winner["config"] == cands[0]["config"]
        submitted = load_recipe(Path(data["run_dir"]) / "recipe.yaml")
        assert Knobs.from_recipe(submitted).describe() == winner["config"]
        assert submitted.training.train_iters == load_recipe(RECIPE, profile="local").training.train_iters
    finally:
        for job in dict.fromkeys(jobs):
            subprocess.run(["scancel", job.split("_")[0]], capture_output=True, timeout=30)
