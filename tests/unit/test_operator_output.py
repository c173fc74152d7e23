"""What the operator reads (issue 47): status shows the run's figures (as summary.json and analyze define them), the
profile, the logs and the checkpoints on disk; status, list, analyze and plan fit an 80-column terminal; units come
from one owner (profiling.units)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hpc_tools.checkpoints.dirs import CheckpointDirs
from hpc_tools.runtime.progress import write_progress
from hpc_tools.testing.synthetic import synthetic_run
from profiling import units
from profiling.figures import reduce_records
from profiling.records import events_path

NARROW = {"COLUMNS": "80"}


def _run_with_saves(tmp_path):
    """A 2-rank run with step records, a progress file and three saves of which keep_last=2 left two on disk."""
    rng = np.random.default_rng(0)
    st = 0.2 + 0.01 * rng.random((2, 12))
    run = synthetic_run(tmp_path, ["cluster.gpus_per_node=2", "training.global_batch_size=2"], st,
                        loss=np.tile(np.linspace(5.0, 4.0, 12), (2, 1)), rss_bytes=np.full((2, 12), 3.9e8))
    write_progress(run.path, 12, 100, "step 12/100 ...", {"loss": 4.0, "lr": 3e-4, "grad_norm": 1.25,
                                                          "tokens_per_s": 999.0}, 450.0, None)
    dirs = CheckpointDirs(run.path / "checkpoints", keep_last=2)
    run.records_dir.mkdir(exist_ok=True)
    with open(events_path(run.records_dir, 0), "w") as f:
        for step in (4, 8, 12):
            (dirs.begin(step) / "model.pt").write_bytes(b"x")
            path = dirs.commit(step)
            f.write(json.dumps({"event": "checkpoint_save", "time": 1.7e9 + step, "seconds": 0.1, "step": step,
                                "rank": 0, "restart": 0, "path": str(path), "verified": True}) + "\n")
    run.logs_dir.mkdir(exist_ok=True)
    (run.logs_dir / "rank00000.out").write_text("step 12/100 ...\n")
    return run, dirs


def test_status_shows_the_runs_figures_lr_profile_logs_and_the_checkpoints_on_disk(tmp_path, cli):
    run, dirs = _run_with_saves(tmp_path)
    job = reduce_records(run.records_dir, 2).figures(2)  # the recipe's warm-up (profiling.warmup_steps = 2)
    out = cli("status", str(run.path))
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert (f"figures  {units.seconds_per_step(job['step_time_median_s'])} median, {units.rate(job['tokens_per_s'])} "
            f"tok/s ({units.rate(job['tokens_per_s_per_gpu'])}/gpu)") in text, text
    assert "peak 0.39 GB" in text and "GiB" not in text, text
    assert "999" not in text  # the last window's rate is not the run's: status shows the run's median only
    assert "lr 3.00e-04, grad norm 1.25, eta 0:07:30" in text, text
    on_disk = dirs.complete()
    assert len(on_disk) == 2, on_disk
    assert f"checkpoints 2 kept in {dirs.root}: step(s) 8, 12; newest iter_0000012; 3 saved, 1 pruned" in text, text
    assert f"logs     {run.logs_dir} (1 file(s))" in text, text
    data = json.loads(cli("status", str(run.path), "--json").stdout)
    assert data["figures"]["step_time_median_s"] == pytest.approx(job["step_time_median_s"])
    assert data["figures"]["tokens_per_s"] == pytest.approx(job["tokens_per_s"])
    assert (data["lr"], data["grad_norm"]) == (3e-4, 1.25)
    assert [c["iteration"] for c in data["checkpoints_kept"]] == [s for s, _ in on_disk]
    assert data["logs"]["files"] == [str(run.logs_dir / "rank00000.out")]
    narrow = cli("status", str(run.path), env=NARROW).stdout
    assert max(len(line) for line in narrow.splitlines()) <= 80, narrow
    assert "pruned" in narrow and "grad norm" in narrow  # wrapped, not cut


def test_status_names_the_local_profile_and_the_cluster_the_recipe_asks_for(tmp_path, cli):
    run, _ = _run_with_saves(tmp_path)
    run.update(profile="local", source="recipes/gpt_3d.yaml", executor="local")
    data = json.loads(cli("status", str(run.path), "--json").stdout)
    assert data["profile"]["used"] == "local" and data["profile"]["asked"] == "2 x 8 H100-SXM"
    assert data["profile"]["ran"] == "1 x 2 cpu"
    text = cli("status", str(run.path)).stdout
    assert "profile  local: ran on 1 x 2 cpu; the recipe asks for 2 x 8 H100-SXM (local run" in text, text


def test_list_and_analyze_fit_80_columns_and_json_keeps_every_field(tmp_path, cli):
    run, _ = _run_with_saves(tmp_path)
    wide = cli("list", "--runs-dir", str(tmp_path))
    assert wide.returncode == 0 and run.run_id in wide.stdout and "EXECUTOR" in wide.stdout, wide.stderr
    narrow = cli("list", "--runs-dir", str(tmp_path), env={"COLUMNS": "50"}).stdout
    assert max(len(line) for line in narrow.splitlines()) <= 50, narrow
    assert run.run_id in narrow and "left out to fit 50 columns" in narrow, narrow
    analyzed = cli("analyze", str(run.path), env=NARROW)
    assert analyzed.returncode == 0, analyzed.stderr
    assert max(len(line) for line in analyzed.stdout.splitlines()) <= 80, analyzed.stdout
    assert "s/step" in analyzed.stdout and " %" in analyzed.stdout  # shares in percent, one way
    data = json.loads(cli("analyze", str(run.path), "--json", env=NARROW).stdout)
    assert {"step_time_median_s", "tokens_per_s_per_gpu", "comm_share", "last_val_loss"} <= set(data["runs"][0])


def test_plan_fits_80_columns_with_a_one_line_verdict_and_a_pointer_to_search(cli):
    out = cli("plan", "recipes/gpt_3d.yaml", "--no-calibration", env=NARROW)
    assert out.returncode == 0, out.stderr
    assert max(len(line) for line in out.stdout.splitlines()) <= 80, out.stdout
    verdict = " ".join(out.stdout[out.stdout.index("verdict: "):].split())
    assert verdict.startswith("verdict: fits, ") and "largest memory term activations" in verdict, verdict
    assert verdict.endswith("faster layouts: plan recipes/gpt_3d.yaml --search"), verdict
    search = cli("plan", "recipes/gpt_3d.yaml", "--search", "--top", "2", "--losers", "1", "--no-calibration",
                 env=NARROW)
    assert search.returncode == 0, search.stderr
    assert max(len(line) for line in search.stdout.splitlines()) <= 80, search.stdout
    apply = search.stdout[search.stdout.index("Apply the best:"):].replace("\\\n", " ")
    # only what changes the recipe: gpt_3d sets data_size -1 and the distributed optimizer already
    assert "--set parallel.tensor_size=1" in apply and "data_size" not in apply, apply
    assert "distributed_optimizer" not in apply, apply


def test_units_one_way_each():
    assert units.gb(3.9e8) == "0.39 GB" and units.pct(0.4065) == "40.6 %" and units.rate(1741.2) == "1.74k"
    assert units.cell("goodput", 0.4065) == "40.6 %" and units.cell("peak_mem_gb", 0.3912) == "0.39"
    assert units.cell("mfu", float("nan")) == "-" and units.hms(3725) == "1:02:05" and units.sci(3e-4) == "3.00e-04"


def test_report_opens_with_a_summary_shows_goodput_one_way_and_draws_lr_norm_throughput_memory_bars(tmp_path):
    """The summary (what ran, the figures with lr and grad norm, the verdict) comes before every table; goodput is a
    percent everywhere; the plots users expect are drawn; per-rank memory is bars at whole ranks; the heatmap's scale
    leaves out the slow warm-up steps."""
    from hpc_tools.analysis.analyze import analyse
    from hpc_tools.analysis.plots import kept
    from hpc_tools.analysis.report import write_report

    st = np.full((4, 20), 0.2)
    st[:, :2] = 5.0  # warm-up (profiling.warmup_steps = 2): 25x the others
    st[:, 2:] += 0.01 * np.arange(4)[:, None]
    run = synthetic_run(tmp_path, ["cluster.gpus_per_node=4", "training.global_batch_size=4"], st,
                        loss=np.tile(np.linspace(5.0, 4.0, 20), (4, 1)),
                        lr=np.tile(np.linspace(1e-3, 1e-4, 20), (4, 1)),
                        grad_norm=np.tile(np.linspace(2.0, 0.5, 20), (4, 1)),
                        rss_bytes=np.array([[4.0e8], [3.0e8], [3.0e8], [3.0e8]]) * np.ones((4, 20)))
    a = analyse([str(run.path)])
    with kept() as figs:
        files = write_report(a, tmp_path / "report")
        by_name = {path.name: fig for fig, path in figs}
    md = (tmp_path / "report" / "report.md").read_text()
    summary = md.split("## Summary")[1].split("## ")[0]
    assert md.index("## Summary") < md.index("## Runs") < md.index("## Method")
    assert f"What ran: {run.run_id} (comm_check" in summary and "s/step (median)" in summary, summary
    assert "last lr 1.00e-04, grad norm 0.5" in summary and "peak memory 0.40 GB" in summary, summary
    assert "Stragglers of " in summary
    goodput = a.runs["goodput"].iloc[0]
    assert f"goodput {units.pct(goodput)}" in summary and f"| {units.pct(goodput)} |" in md  # one way: percent
    table = [ln.strip("|").split(" | ") for ln in md.split("## Goodput")[1].splitlines() if ln.startswith("| ")]
    assert table[1][table[0].index("goodput")].strip() == units.pct(goodput), table
    names = {p.rsplit("/", 1)[-1] for p in files["plots"]}
    assert {"throughput_over_steps.png", "learning_rate.png", "grad_norm.png", "memory_per_rank.png"} <= names
    bars = by_name["memory_per_rank.png"].axes[0].patches
    assert sorted(round(b.get_height(), 2) for b in bars) == [0.3, 0.3, 0.3, 0.4]  # one bar per rank, no line
    tput = by_name["throughput_over_steps.png"].axes[0].get_lines()[0]
    assert min(tput.get_xdata()) == 3  # the warm-up steps are left out
    heat = by_name["heatmap_0.png"].axes[0].images[0]
    assert heat.get_clim()[1] == pytest.approx(0.23)  # the slowest step after warm-up sets the top, not 5 s


def test_report_of_one_run_goes_to_its_folder_and_several_need_out(tmp_path, cli):
    """README's `hpc-tools report runs/<id>`: without --out, report/ inside the one run named (by folder or id);
    several runs or sweeps need --out, refused in one line before anything is read or written."""
    run, _ = _run_with_saves(tmp_path)
    by_id = cli("report", run.run_id, "--runs-dir", str(run.path.parent))
    assert by_id.returncode == 0, by_id.stderr
    assert (run.path / "report" / "report.md").is_file() and (run.path / "report" / "report.html").is_file()
    assert by_id.stdout.strip().splitlines()[-1] == str(run.path / "report" / "report.html")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    two = cli("report", str(run.path), str(run.path))
    assert two.returncode == 2 and len(two.stderr.strip().splitlines()) == 1 and "give --out DIR" in two.stderr
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
