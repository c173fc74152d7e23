"""``eval`` and ``quantize`` end to end on the local executor, offline, on a task written here (lm-eval YAML over a
local jsonl): the tiny GPT (Megatron, recipes/gpt_3d.yaml's local profile: the README's main command, shared with the
tests that read it) and the tiny Llama (FSDP, recipes/llama_fsdp.yaml's local profile on 2 ranks, 12 steps with a
checkpoint every 4, trained here) are evaluated; the scores land in ``<run>/eval/``, ``status --json`` and the
report; three checkpoints of one run are evaluated in turn (local) and rendered as one job array (Slurm); int8
quantization keeps the linear weights at most ~55 % of their bf16 bytes and its score is reported beside the
unquantized one; every input that can be wrong is refused in one line, exit 2, with nothing written.

``submit`` runs as a user runs it, in a fresh process (it starts the ranks); ``eval``, ``quantize``, ``status`` and
``report`` run in this one (``hpc_tools.cli.main``, the same code as ``python -m hpc_tools``: ``eval`` and ``quantize``
run in the command's own process, and a fresh one per call would import torch, transformers and lm-eval again, four
times), and the Llama trains on 2 ranks, not the profile's 4 (an evaluation reads a
checkpoint whatever the rank count that wrote it; 4 ranks on a 2-core machine only queue for the cores).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers import in_process, run_cli

pytestmark = [pytest.mark.slow]

TASK = "hpc_tiny_choice"
LIMIT = "6"
LLAMA_ITERS = (4, 8, 12)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    """An lm-eval multiple-choice task over a local jsonl (absolute path: lm-eval reads data_files from the cwd)."""
    folder = tmp_path_factory.mktemp("tasks")
    rows = [{"context": f"The {w} is", "choices": [f" {w}", " the"], "label": i % 2}
            for i, w in enumerate(["red", "blue", "cat", "dog", "sun", "moon", "tree", "sea"])]
    (folder / "tiny.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "tiny.yaml").write_text(f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'tiny.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_target: label
doc_to_choice: choices
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    return folder


@pytest.fixture(scope="module")
def gpt_run(main_command) -> Path:
    out = main_command("recipes/gpt_3d.yaml")
    assert out["returncode"] == 0, out["stderr"][-3000:]
    return Path(out["result"]["run_dir"])


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("llama_runs")
    out = run_cli("submit", "recipes/llama_fsdp.yaml", "--executor", "local", "--json", "--runs-dir", str(root),
                  "--set", f"training.train_iters={LLAMA_ITERS[-1]}", "--set", "checkpoint.interval_iters=4",
                  "--set", "checkpoint.keep_last=3", "--set", "cluster.gpus_per_node=2", timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return Path(json.loads(out.stdout)["run_dir"])


def cli_json(*args: str) -> dict:
    return json.loads(in_process(*args, "--json"))


def status_json(run: Path) -> dict:
    return json.loads(in_process("status", str(run), "--json"))


def evaluate(ref, task_dir, *extra: str) -> dict:
    return cli_json("eval", str(ref), "--tasks", TASK, "--include-path", str(task_dir), "--limit", LIMIT, *extra)


def report_text(run: Path, out: Path) -> str:
    in_process("report", str(run), "--out", str(out))
    return (out / "report.md").read_text()


def acc_of(path: Path) -> float:
    data = json.loads(path.read_text())
    assert data["hpc_tools"]["limit"] == int(LIMIT)
    return data["results"][TASK]["acc,none"]


@pytest.mark.megatron
def test_gpt_run_scores_land_in_the_run_status_and_report(gpt_run, task_dir, tmp_path):
    out = evaluate(gpt_run, task_dir)
    (done,) = out["evaluated"]
    assert done["iteration"] == 30 and Path(done["file"]) == gpt_run / "eval" / "iter_0000030.json"
    acc = acc_of(gpt_run / "eval" / "iter_0000030.json")
    assert 0.0 <= acc <= 1.0
    rows = status_json(gpt_run)["eval"]["results"]
    assert [(r["iteration"], r["task"], r["metric"], r["value"]) for r in rows] == [(30, TASK, "acc", acc)]
    text = report_text(gpt_run, tmp_path / "report")
    assert "## Evaluation" in text and TASK in text


def test_llama_three_checkpoints_in_turn_and_plotted(llama_run, task_dir, tmp_path):
    out = evaluate(llama_run, task_dir, "--iterations", ",".join(map(str, LLAMA_ITERS)))
    assert [d["iteration"] for d in out["evaluated"]] == list(LLAMA_ITERS)
    for it in LLAMA_ITERS:
        assert 0.0 <= acc_of(llama_run / "eval" / f"iter_{it:07d}.json") <= 1.0
        assert (llama_run / "exports" / f"iter_{it:07d}" / "config.json").is_file()
    rows = [r for r in status_json(llama_run)["eval"]["results"] if r["model"] == "unquantized"]
    assert sorted(r["iteration"] for r in rows) == list(LLAMA_ITERS)
    tokens = [r["tokens"] for r in sorted(rows, key=lambda r: r["iteration"])]
    assert tokens[0] > 0 and tokens == [tokens[0] * it // LLAMA_ITERS[0] for it in LLAMA_ITERS]
    text = report_text(llama_run, tmp_path / "report")
    assert "## Evaluation" in text and (tmp_path / "report" / "eval_score_vs_tokens.png").is_file()


def test_several_checkpoints_on_slurm_are_one_job_array(llama_run, task_dir):
    out = evaluate(llama_run, task_dir, "--iterations", "4,8,12", "--executor", "slurm", "--render")
    assert out["job_id"] is None and out["iterations"] == list(LLAMA_ITERS)
    script = Path(out["script"]).read_text()
    assert "#SBATCH --array=0-2\n" in script and "#SBATCH --nodes=1\n" in script
    assert "ITERATIONS=(4 8 12)" in script and '--iterations "$ITERATION" --executor local' in script
    assert f"--include-path {task_dir}" in script and f"--limit {LIMIT}" in script
    assert "%A_%a.out" in script  # one log per array task


def test_quantized_int8_is_smaller_and_scored_beside_the_original(llama_run, task_dir, tmp_path):
    if not (llama_run / "eval" / f"iter_{LLAMA_ITERS[-1]:07d}.json").is_file():
        evaluate(llama_run, task_dir)
    q = cli_json("quantize", str(llama_run), "--scheme", "int8", "--out", str(tmp_path / "q8"))
    assert q["iteration"] == LLAMA_ITERS[-1] and q["linear_modules"] > 0
    assert q["ratio_vs_bf16"] <= 0.55 and q["folder_bytes_after"] < q["folder_bytes_before"]
    assert json.loads((tmp_path / "q8" / "config.json").read_text())["quantization_config"]["quant_method"] == "torchao"
    evaluate(tmp_path / "q8", task_dir)
    scored = llama_run / "eval" / f"iter_{LLAMA_ITERS[-1]:07d}-int8.json"
    acc = acc_of(scored)
    info = status_json(llama_run)["eval"]
    (delta,) = [d for d in info["score_deltas"] if d["model"] == "int8"]
    assert delta["quantized"] == acc and delta["iteration"] == LLAMA_ITERS[-1]
    assert [x["scheme"] for x in info["quantized"]] == ["int8"]
    text = report_text(llama_run, tmp_path / "report")
    assert "Quantized models" in text and "int8" in text


def tree(*roots: Path) -> dict:
    return {str(p): p.stat().st_mtime_ns for root in roots if root.exists() for p in sorted(root.rglob("*"))}


# Every command input that can be wrong: (argv, what the one error line names). {gpt}/{llama}: the runs, {bare}: the
# Llama run without its checkpoints, {empty}: an empty folder, {tasks}: the task folder, {out}: a new folder,
# {full}: a non-empty one, {model}: the Llama run's exported folder, {q}: a quantized folder.
BAD = [
    (["eval", "{empty}", "--tasks", TASK], "neither a run folder"),
    (["eval", "no-such-run", "--tasks", TASK], "neither a run"),
    (["eval", "{bare}", "--tasks", TASK, "--include-path", "{tasks}"], "has no verified checkpoint"),
    (["eval", "{llama}", "--tasks", TASK, "--include-path", "{tasks}", "--iterations", "5"],
     "no complete checkpoint at iteration(s) 5"),
    (["eval", "{llama}", "--tasks", "hpc_no_such_task", "--include-path", "{tasks}"], "is not an lm-eval task"),
    (["eval", "{llama}", "--tasks", TASK, "--include-path", "{empty}"], "holds no .yaml task file"),
    (["eval", "{llama}", "--tasks", TASK, "--include-path", "{out}"], "is not a folder"),
    (["eval", "{llama}", "--tasks", ","], "names no task"),
    (["eval", "{llama}", "--tasks", TASK, "--limit", "0"], "--limit"),
    (["eval", "{llama}", "--tasks", TASK, "--batch-size", "x"], "--batch-size"),
    (["eval", "{llama}", "--tasks", TASK, "--iterations", "4,4"], "--iterations"),
    (["eval", "{llama}", "--tasks", TASK, "--executor", "pbs"], "--executor"),
    (["eval", "{llama}", "--tasks", TASK, "--include-path", "{tasks}", "--render"], "--render writes a Slurm"),
    (["eval", "{model}", "--tasks", TASK, "--include-path", "{tasks}", "--iterations", "4"], "is a model folder"),
    (["eval", "{model}", "--tasks", TASK, "--include-path", "{tasks}", "--executor", "slurm", "--render"],
     "is a model folder"),
    (["quantize", "{empty}", "--scheme", "int8", "--out", "{out}"], "neither a run folder"),
    (["quantize", "{llama}", "--scheme", "int3", "--out", "{out}"], "--scheme"),
    (["quantize", "{llama}", "--scheme", "int8", "--out", "{full}"], "is not empty"),
    (["quantize", "{bare}", "--scheme", "int8", "--out", "{out}"], "has no verified checkpoint"),
    (["quantize", "{q}", "--scheme", "int8", "--out", "{out}"], "is already quantized"),
]


@pytest.fixture(scope="module")
def places(gpt_run, llama_run, tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("bad")
    bare = base / "bare-run"
    shutil.copytree(llama_run, bare, ignore=shutil.ignore_patterns("checkpoints", "eval"))
    (bare / "checkpoints").mkdir()
    (base / "empty").mkdir()
    (base / "full").mkdir()
    (base / "full" / "keep.txt").write_text("x")
    model = llama_run / "exports" / "iter_0000004"
    if not (model / "config.json").is_file():
        from hpc_tools.hf.export import export_run

        export_run(llama_run, model, 4, overwrite=True)
    q = base / "q"
    q.mkdir()
    (q / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (q / "hpc_tools_quantize.json").write_text(json.dumps({"scheme": "int8"}))
    return {"gpt": gpt_run, "llama": llama_run, "bare": bare, "empty": base / "empty", "out": base / "new",
            "full": base / "full", "model": model, "q": q, "base": base}


@pytest.mark.parametrize("argv,needle", BAD, ids=[" ".join(a[:1] + a[-2:]) for a, _ in BAD])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(places, task_dir, argv, needle, capsys):
    from hpc_tools.cli import main

    places = {**places, "tasks": task_dir}
    watched = [places["gpt"] / "eval", places["llama"], places["base"]]
    before = tree(*watched)
    try:
        code = main([a.format(**places) for a in argv])
    except SystemExit as exc:  # argparse's refusal: its usage, then the one error line
        code = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    errors = [ln for ln in err if "error:" in ln]
    assert code == 2 and len(errors) == 1 and needle in errors[0], err[-5:]
    assert err[-1] == errors[0]
    assert tree(*watched) == before and not places["out"].exists()
