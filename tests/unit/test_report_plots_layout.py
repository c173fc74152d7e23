"""The report's plots are readable: legends beside the data and inside the figure, short labels naming only what
varies, repeats as one line with a band, scaling curves only for runs that differ in scale, validation loss drawn when
the records carry it (and nothing breaks when they do not), MFU / memory timeline / predicted-vs-measured plots, tables
that fit the page; the report opens in headless Chromium with every image decoded and no sideways page scroll.

Data: synthetic run folders written with the real record schema (``hpc_tools.testing.synthetic_sweep``).
"""

from __future__ import annotations

import re
import subprocess
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from hpc_tools.analysis import plots
from hpc_tools.analysis.analyze import analyse
from hpc_tools.analysis.report import render_html, render_markdown, write_report
from hpc_tools.testing.synthetic import amdahl_times, synthetic_run
from hpc_tools.testing.synthetic_sweep import curves, synthetic_sweep
from tests.integration.test_report_local_sweep import CHECK_JS, chromium_or_skip

# A GPU recipe the planner models, so that predictions exist (the records are synthetic; no GPU is used).
GPU = ("backend.kind=megatron", "cluster.gpu_type=h100", "cluster.gpus_per_node=8", "model.num_layers=8",
       "model.hidden_size=1024", "model.num_attention_heads=16", "model.seq_length=1024",
       "training.global_batch_size=32", "training.train_iters=30")
TP_PP = {"parallel.tensor_size": [1, 2], "parallel.pipeline_size": [1, 2, 4]}
LABELS = {"tp=1 pp=1", "tp=1 pp=2", "tp=1 pp=4", "tp=2 pp=1", "tp=2 pp=2", "tp=2 pp=4"}


def _tp_pp_times(params, rng):
    tp, pp = params["parallel.tensor_size"], params["parallel.pipeline_size"]
    return 0.5 * (1 + 0.1 * tp + 0.1 * pp) * (1 + 0.02 * rng.standard_normal((8, 30)))


@contextmanager
def _reported(a, out: Path, title: str):
    """The report of an analysis, its plots' figures kept open (drawn once, when saved): (files, {name: figure})."""
    with plots.kept() as figs:
        files = write_report(a, out, title)
        yield files, {path.name: fig for fig, path in figs}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """The issue's case: a 12-run sweep (tp x pp, 2 repeats each), with validation loss; analysed and reported."""
    root = tmp_path_factory.mktemp("tp_pp")
    folder = synthetic_sweep(root, TP_PP, _tp_pp_times, repeats=2, base_overrides=GPU, name="tp-pp")
    a = analyse([str(folder)])
    with _reported(a, root / "report", "tp-pp") as (files, figs):
        yield a, files, root / "report", figs


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    root = tmp_path_factory.mktemp("single")
    rng = np.random.default_rng(3)
    run = synthetic_run(root / "runs", list(GPU), 0.6 * (1 + 0.02 * rng.standard_normal((8, 30))),
                        **curves(8, 30, rng, eval_interval=5))
    a = analyse([str(run.path)])
    with _reported(a, root / "report", "single") as (files, figs):
        yield a, files, root / "report", figs


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """A strong-scaling sweep (1, 2, 4 GPUs x 2 repeats) next to runs of another model: the other model at 1 and 2 GPUs
    is a series of its own; a third model at 8 GPUs is in no series."""
    root = tmp_path_factory.mktemp("mixed")
    rng = np.random.default_rng(11)
    base = ["training.global_batch_size=16", "training.train_iters=20"]
    for gpus in (1, 2, 4):
        for _ in range(2):
            synthetic_run(root, [*base, f"cluster.gpus_per_node={gpus}"], amdahl_times(gpus, 0.1, 1.0, 20, 0.01, rng))
    for gpus in (1, 2):
        synthetic_run(root, [*base, f"cluster.gpus_per_node={gpus}", "model.hidden_size=128"],
                      amdahl_times(gpus, 0.1, 2.0, 20, 0.01, rng))
    odd = synthetic_run(root, [*base, "cluster.gpus_per_node=8", "model.hidden_size=256"],
                        amdahl_times(8, 0.1, 3.0, 20, 0.01, rng))
    a = analyse([str(root)], warmup=0)
    with _reported(a, root / "report", "mixed") as (files, figs):
        yield a, files, root / "report", figs, odd.run_id


def _legend_texts(fig) -> list[str]:
    return [t.get_text() for leg in fig.legends for t in leg.get_texts()]


@pytest.mark.parametrize("case", ["sweep", "single", "mixed"])
def test_legends_beside_the_data_inside_the_figure_and_nothing_overprints(case, request):
    figs = request.getfixturevalue(case)[3]
    assert len(figs) >= 5, sorted(figs)
    for name, fig in figs.items():
        assert plots.layout_problems(fig) == [], name
        renderer = fig.canvas.get_renderer()
        for leg in fig.legends:  # the rule spelled out with the artists' extents
            box = leg.get_window_extent(renderer)
            assert fig.bbox.x0 - 1 <= box.x0 and box.x1 <= fig.bbox.x1 + 1, name
            assert fig.bbox.y0 - 1 <= box.y0 and box.y1 <= fig.bbox.y1 + 1, name
            assert not any(box.overlaps(ax.bbox) for ax in fig.axes), name
        texts = _legend_texts(fig)
        assert len(texts) == len(set(texts)), (name, texts)


def test_the_layout_check_finds_what_it_looks_for():
    """A legend over the data, a legend cut off, a repeated name and overprinted tick labels are each found."""
    plt = plots._plt()
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot(range(10), label="a")
    ax.plot(range(10), label="a")
    ax.legend(loc="center")
    problems = " ".join(plots.layout_problems(fig))
    assert "over the axes" in problems and "repeated" in problems
    fig2, ax2 = plt.subplots(figsize=(4, 3))
    ax2.plot(range(10), label="x")
    ax2.legend(loc="upper left", bbox_to_anchor=(1.3, 1))
    ax2.set_xticks(range(10), [f"a long label {i}" for i in range(10)])
    problems = " ".join(plots.layout_problems(fig2))
    assert "outside the figure" in problems and "tick labels overlap" in problems
    plt.close(fig)
    plt.close(fig2)


def test_labels_name_only_what_varies(sweep):
    a, figs = sweep[0], sweep[3]
    assert set(a.runs["short_label"]) == LABELS
    assert set(a.runs["label"]) == {lbl.replace("tp=", "tensor_size=").replace("pp=", "pipeline_size=")
                                    for lbl in LABELS}  # the sweep's own labels, kept in the table
    assert set(_legend_texts(figs["loss_curves.png"])) == LABELS | {"train", "validation"}
    assert {t.get_text().replace("\n", " ") for t in figs["step_time_breakdown.png"].axes[0].get_xticklabels()} \
        == LABELS


def test_repeats_are_one_line_with_a_band(sweep):
    a, figs = sweep[0], sweep[3]
    named = plots.groups(a)
    assert len(named) == 6 and all(len(ids) == 2 for _, ids in named)
    ax = figs["loss_curves.png"].axes[0]
    train = [ln for ln in ax.get_lines() if ln.get_label() in LABELS]
    assert len(train) == 6  # one line per configuration, not one per run
    assert len(ax.collections) >= 6  # each with its band (fill_between over the repeats)
    assert len(figs["step_time_breakdown.png"].axes[0].get_xticks()) == 6


def test_unrelated_runs_form_no_scaling_series(mixed):
    a, files, report, figs, odd = mixed
    assert len(a.scaling) == 2
    hidden = dict(zip(a.runs["run_id"], a.runs["config_key"]))
    for s in a.scaling:
        assert len({hidden[r] for r in s.run_ids}) == 1  # one configuration per series
        assert odd not in s.run_ids
    assert sorted(len(s.run_ids) for s in a.scaling) == [2, 6]
    texts = _legend_texts(figs["throughput_vs_gpus.png"])
    assert texts.count("ideal (linear)") == 1, texts
    assert sorted(t for t in texts if t.startswith("measured")) == ["measured, hidden=128 (strong)",
                                                                    "measured, hidden=64 (strong)"]
    md = (report / "report.md").read_text()
    section = md.split("## Outside any scaling series")[1].split("## Stragglers")[0]
    assert "hidden=256" in section and "1 run(s) belong to no scaling series" in section


def test_validation_loss_is_drawn_when_the_records_carry_it(sweep, single):
    a, files = sweep[0], sweep[1]
    names = {Path(p).name for p in files["plots"]}
    assert {"loss_curves.png", "val_loss_vs_tokens.png"} <= names
    assert a.runs["last_val_loss"].notna().all()
    evaluated = a.steps.dropna(subset=["val_loss"])
    assert set(evaluated["step"]) == {10, 20, 30}  # curves(): every 10th step
    ax = single[3]["loss_curves.png"].axes[0]
    dashed = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--" and len(ln.get_xdata()) == 6]
    assert dashed and list(dashed[0].get_xdata()) == [5, 10, 15, 20, 25, 30]
    assert ax.get_title() == "Training and validation loss"


def test_version_1_records_without_validation_loss_still_report(tmp_path):
    rng = np.random.default_rng(2)
    run = synthetic_run(tmp_path / "runs", [], 0.1 * (1 + 0.01 * rng.standard_normal((2, 20))),
                        **curves(2, 20, rng, eval_interval=None))
    for path in run.records_dir.glob("rank*.parquet"):  # as a version-1 writer left them: no evaluation columns
        table = pq.read_table(path)
        table = table.drop_columns([c for c in ("val_loss", "eval_time_s") if c in table.column_names])
        table = table.set_column(table.column_names.index("schema_version"), "schema_version",
                                 [np.ones(table.num_rows, dtype=np.int64)])
        pq.write_table(table, path)
    a = analyse([str(run.path)])
    assert a.steps["val_loss"].isna().all() and a.runs["last_val_loss"].isna().all()
    with plots.kept() as kept:
        plots.loss(a, tmp_path)
        plots.val_loss_vs_tokens(a, tmp_path)
        ((fig, path),) = kept  # the loss curves only
        assert path.name == "loss_curves.png" and fig.axes[0].get_title() == "Training loss"
        assert "validation" not in _legend_texts(fig)
    assert "last_val_loss" in render_markdown(a, [], "v1") and "last_val_loss" in render_html(a, [], "v1")


def test_the_new_plots_exist(sweep, single):
    for (_, files, *_) in (sweep, single):
        names = {Path(p).name for p in files["plots"]}
        assert {"mfu_over_steps.png", "memory_timeline.png", "predicted_vs_measured.png"} <= names, names
    a = single[0]
    row = a.runs.iloc[0]
    assert row["predicted_step_time_s"] > 0 and row["predicted_mem_allocated_bytes"] > 0


def test_tables_fit_the_page(sweep):
    report = sweep[2]
    html = (report / "report.html").read_text()
    tables = re.findall(r"<table>.*?</table>", html, flags=re.S)
    assert tables and all(html.count(f"<div class='scroll'>{t}</div>") for t in tables)  # each scrolls sideways
    for t in tables:
        head = re.search(r"<thead>(.*?)</thead>", t, flags=re.S).group(1)
        assert head.count("<th>") <= 16, head
    md = (report / "report.md").read_text()
    widths = [line.count("|") - 1 for line in md.splitlines() if line.startswith("| #")]
    assert widths and max(widths) <= 16


@pytest.mark.slow  # starts a browser
def test_report_opens_in_headless_chromium_without_sideways_scroll(sweep, tmp_path):
    files, report = sweep[1], sweep[2]
    browser = chromium_or_skip()
    html = (report / "report.html").read_text()
    n_images = html.count("<img ")
    assert n_images == len(files["plots"]) >= 9
    width_js = ("<script>window.addEventListener('load',()=>{document.body.setAttribute('data-page-wider',"
                "String(document.documentElement.scrollWidth>window.innerWidth));"
                "const wide=[...document.querySelectorAll('.scroll')].filter(d=>d.scrollWidth>d.clientWidth).length;"
                "document.body.setAttribute('data-wide-tables',String(wide));});</script>")
    check = tmp_path / "check.html"
    check.write_text(html.replace("</body>", CHECK_JS + width_js + "</body>"))
    out = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
                          "--window-size=1280,900", "--virtual-time-budget=5000", "--dump-dom", check.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f'data-images="{n_images}/{n_images}"' in out.stdout
    assert 'data-page-wider="false"' in out.stdout
    assert 'data-wide-tables="0"' in out.stdout  # at 1280 px every table of this sweep fits without scrolling


def test_timelines_are_the_range_and_mean_over_ranks(tmp_path):
    """memory_timeline and mfu_over_steps read per-step columns: max/min over the ranks (an unmeasured rank is
    skipped) and the mean MFU, as computed here by hand."""
    alloc = np.array([[1e9, 2e9, 3e9, 4e9], [2e9, 1e9, 5e9, 4e9], [3e9, 3e9, 1e9, 4e9]])
    mfu = np.array([[0.2, 0.3, np.nan, 0.4], [0.4, 0.3, 0.5, 0.2], [0.3, 0.3, 0.2, 0.3]])
    run = synthetic_run(tmp_path, [], np.full((3, 4), 0.1), mem_allocated_max_bytes=alloc.astype(np.int64), mfu=mfu)
    steps = analyse([str(run.path)], warmup=0).steps.set_index("step")
    np.testing.assert_allclose(steps["mem_allocated_max_bytes_max"], alloc.max(axis=0))
    np.testing.assert_allclose(steps["mem_allocated_max_bytes_min"], alloc.min(axis=0))
    np.testing.assert_allclose(steps["mfu"], np.nanmean(mfu, axis=0))
    assert "rss_bytes_max" not in steps  # no rank recorded it: no timeline, no empty column
