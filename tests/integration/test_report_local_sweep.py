"""A real sweep, run locally (comm_check ranks over gloo), analysed and reported; numbers checked by hand.

The report's numbers are recomputed here from the ranks' JSON-lines records (the analysis reads the parquet files),
and report.html is opened in headless Chromium: no console errors, every image decoded.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from tests.helpers import REPO, run_cli

CHECK_JS = ("<script>window.addEventListener('load',()=>{const imgs=[...document.images];"
            "const ok=imgs.filter(i=>i.complete&&i.naturalWidth>0).length;console.log('IMAGES_OK '+ok+'/'+imgs.length);"
            "document.body.setAttribute('data-images',ok+'/'+imgs.length);});</script>")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """comm_check over 1 and 2 local ranks, 2 repeats: 4 runs, 6 rank processes."""
    tmp = tmp_path_factory.mktemp("sweep")
    raw = yaml.safe_load((REPO / "recipes/comm_check.yaml").read_text())
    raw["local"]["training"]["train_iters"] = 8
    raw["sweep"] = {"grid": {"cluster.gpus_per_node": [1, 2]}, "repeats": 2}
    recipe = tmp / "cc_sweep.yaml"
    recipe.write_text(yaml.safe_dump(raw, sort_keys=False))
    out = run_cli("sweep", str(recipe), "--executor", "local", "--runs-dir", str(tmp / "runs"), "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads(out.stdout)
    report = tmp / "report"
    rep = run_cli("report", data["sweep"], "--out", str(report), "--json")
    assert rep.returncode == 0, rep.stderr[-3000:]
    return data, json.loads(rep.stdout), report


def test_every_cell_completed_and_status_agrees(sweep):
    data, _, _ = sweep
    assert data["summary"] == {"completed": 4}
    assert sorted((c["params"]["cluster.gpus_per_node"], c["repeat"]) for c in data["cells"]) == \
        [(1, 0), (1, 1), (2, 0), (2, 1)]
    out = run_cli("sweep", "status", data["sweep"], "--json")
    assert out.returncode == 0, out.stderr
    assert {c["status"] for c in json.loads(out.stdout)["cells"]} == {"completed"}


def hand_metrics(run_dir: Path, warmup: int) -> dict:
    """Median slowest-rank step time after warm-up and tokens/s per GPU, straight from the JSON lines."""
    per_step: dict[int, float] = {}
    tokens = set()
    files = sorted((run_dir / "records").glob("rank*.jsonl"))
    for path in files:
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec["step"] > warmup:
                per_step[rec["step"]] = max(per_step.get(rec["step"], 0.0), rec["step_time_s"])
                tokens.add(rec["tokens"])
    (tok,) = tokens
    median = float(np.median(list(per_step.values())))
    return {"ranks": len(files), "median": median, "tokens_per_s_per_gpu": tok / median / len(files),
            "steps": len(per_step)}


def test_report_numbers_equal_a_hand_computation(sweep):
    data, files, report = sweep
    runs = pd.read_csv(report / "runs.csv")
    assert len(runs) == 4
    sweep_dir = Path(data["sweep"])
    for cell in data["cells"]:
        row = runs[runs["run_id"] == cell["run_id"]].iloc[0]
        hand = hand_metrics(sweep_dir / cell["run_dir"], warmup=2)  # profiling.warmup_steps default
        assert row["world_size"] == hand["ranks"] == cell["params"]["cluster.gpus_per_node"]
        assert row["steps_measured"] == hand["steps"] == 6
        assert row["step_time_median_s"] == pytest.approx(hand["median"], rel=1e-9)
        assert row["tokens_per_s_per_gpu"] == pytest.approx(hand["tokens_per_s_per_gpu"], rel=1e-9)
    # The per-run parquet table holds the same numbers as the CSV.
    pq_runs = pd.read_parquet(report / "runs.parquet")
    np.testing.assert_allclose(pq_runs["step_time_median_s"], runs["step_time_median_s"])
    # Scaling: comm_check's global batch grows with the ranks (weak scaling); efficiency = T(1) / T(n).
    scaling = pd.read_csv(report / "scaling_0.csv")
    mean_t = runs.groupby("world_size")["step_time_median_s"].mean()
    assert list(scaling["world_size"]) == [1, 2] and list(scaling["repeats"]) == [2, 2]
    np.testing.assert_allclose(scaling["efficiency"], mean_t.iloc[0] / mean_t.to_numpy(), rtol=1e-9)
    names = {Path(p).name for p in files["plots"]}
    assert {"throughput_vs_gpus.png", "efficiency_vs_gpus.png", "step_time_breakdown.png", "memory_per_rank.png",
            "heatmap_0.png"} <= names
    md = (report / "report.md").read_text()
    assert "weak scaling" in md and "![throughput_vs_gpus](throughput_vs_gpus.png)" in md
    # Two GPU counts cannot carry a fit: the report says so, with the spread and the reason, and projects nothing.
    spread = scaling["spread"].max()
    assert f"Gustafson: 2 GPU counts, spread {spread:.0%}: no fit (" in md and "3 or more GPU counts" in md
    assert "No projection beyond the measured GPU counts." in md and "Projection (" not in md
    assert "serial fraction s =" not in md and not (report / "projection_0.csv").exists()
    assert (scaling["efficiency_lo"] <= scaling["efficiency"]).all()  # the plots' error bars
    assert (scaling["efficiency"] <= scaling["efficiency_hi"]).all()


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def chromium_or_skip() -> str:
    """The headless browser, else skip the test (fail it in CI, which installs one). Where environment/test.sh is
    installing it beside the tests (it exports HPC_TOOLS_CHROMIUM_LOCK), its script is run again: it waits for that
    install."""
    browser = chromium()
    if browser is None and os.environ.get("HPC_TOOLS_CHROMIUM_LOCK"):
        subprocess.run(["bash", str(REPO / "environment" / "install-chromium.sh")], capture_output=True, timeout=1200)
        browser = chromium()
    if browser is None:
        why = "headless Chromium is not installed (apt-get install -y chromium)"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    return browser


def test_report_html_opens_in_headless_chromium(sweep, tmp_path):
    _, files, report = sweep
    browser = chromium_or_skip()
    html = (report / "report.html").read_text()
    assert "<script" not in html and "http://" not in html and "https://" not in html  # self-contained, no JS
    n_images = html.count("<img ")
    assert n_images == len(files["plots"]) and n_images >= 5
    check = tmp_path / "check.html"
    check.write_text(html.replace("</body>", CHECK_JS + "</body>"))
    out = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
                          "--virtual-time-budget=5000", "--dump-dom", check.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    console = [ln for ln in out.stderr.splitlines() if "CONSOLE" in ln]
    # Our own console.log line proves console output is captured, so "no error lines" means something.
    assert any(f"IMAGES_OK {n_images}/{n_images}" in ln for ln in console), console
    errors = [ln for ln in console if "ERROR" in ln.split("CONSOLE")[0] or "Uncaught" in ln or "Failed to load" in ln]
    assert not errors, errors
    assert f'data-images="{n_images}/{n_images}"' in out.stdout
