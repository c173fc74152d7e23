"""benchmarks/gpu_side_by_side.py and gpu_mfu.py's FSDP path without a GPU: the three commands and torchtitan's
generated config (checked against torchtitan 0.3.0's own config parser where torchtitan imports), one FLOPs
convention for all three paths (the arithmetic by hand), torchtitan's log lines read back, the table's MFU and ratios,
the datasets stand-in, and gpu_mfu's dry and CPU runs of both backends."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.util import find_spec

import pytest

from tests.helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_mfu  # noqa: E402
import gpu_side_by_side as sbs  # noqa: E402

# Llama 3.2 1B as its model card gives it: what all three paths must train
LLAMA_1B = {"layers": 16, "h": 2048, "heads": 32, "groups": 8, "ffn": 8192, "vocab": 128256, "params": 1_235_814_400}


def hand_flops_per_token(seq: int) -> float:
    """Megatron convention by hand: 3 x (per layer: Q, K, V, O projections + the causal half of QK^T and PV + three
    SwiGLU matrices; once: the logits)."""
    h, a, g, f, v = LLAMA_1B["h"], LLAMA_1B["heads"], LLAMA_1B["groups"], LLAMA_1B["ffn"], LLAMA_1B["vocab"]
    d = h // a
    projections = 2 * h * (a * d + 2 * g * d) + 2 * a * d * h
    core = 4 * seq * a * d / 2
    mlp = 3 * 2 * h * f
    return 3 * (LLAMA_1B["layers"] * (projections + core + mlp) + 2 * h * v)


def test_one_flops_convention_by_hand():
    assert sbs.flops_per_token() == pytest.approx(hand_flops_per_token(2048), rel=1e-12)
    args = gpu_mfu.parse_args(["--backend", "fsdp", "--size", "llama-1b", "--micro-batch", "4", "--accum", "2"])
    recipe = gpu_mfu.build_recipe(args, "H100-SXM")
    assert gpu_mfu.model_flops(recipe) == pytest.approx(hand_flops_per_token(2048) * 8 * 2048, rel=1e-12)
    megatron = gpu_mfu.build_recipe(gpu_mfu.parse_args(["--size", "llama-1b", "--micro-batch", "4", "--accum", "2"]),
                                    "H100-SXM")
    assert gpu_mfu.model_flops(megatron) == gpu_mfu.model_flops(recipe)  # 128256 is Megatron's padding already


def test_both_paths_build_llama_1b():
    from profiling.flops import num_parameters

    for backend in ("fsdp", "megatron"):
        m = gpu_mfu.build_recipe(gpu_mfu.parse_args(["--backend", backend, "--size", "llama-1b"]), "H100-SXM").model
        assert (m.family, m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.ffn_hidden_size,
                m.vocab_size, m.untie_embeddings) == ("llama", 16, 2048, 32, 8, 8192, 128256, False)
        assert num_parameters(m, m.vocab_size) == LLAMA_1B["params"]


def test_fsdp_sizes_are_llamas():
    assert [gpu_mfu.llama_ffn(h) for h in (2048, 2560, 4096)] == [5632, 6912, 11008]  # 8/3 h up to 256: Llama's
    m = gpu_mfu.build_recipe(gpu_mfu.parse_args(["--backend", "fsdp", "--size", "1.3b"]), "H100-SXM").model
    assert (m.family, m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size) == \
        ("llama", 24, 2048, 16, 5632)


def titan_line(step: int, loss: float, tps: float, mfu: float | None) -> str:
    """A step line as torchtitan 0.3.0's MetricsProcessor.log writes it without colours (components/metrics.py)."""
    mfu_str = f"{mfu:.2f}%" if mfu is not None else "N/A"
    return (f"[rank0]:[titan] 2026-12-07 12:00:00,000 - root - INFO - step: {step:2}  loss: {loss:8.5f}  "
            f"grad_norm: {1.5:7.4f}  memory: {30.1:5.2f}GiB(38.00%)  tps: {round(tps):,}  tflops: {123.4:,.2f}  "
            f"mfu: {mfu_str}")


def test_torchtitan_log_read_back():
    lines = [titan_line(s, 12.0 - s / 10, 10_000 if s <= 3 else 40_000 + 1000 * s, 40.0 + s) for s in range(1, 10)]
    lines.insert(4, "[rank0]:[titan] ... - root - INFO - Training starts at step 1")
    got = sbs.titan_figures("\n".join(lines), warmup=3)
    assert got["tokens_per_s"] == 46_500  # median of steps 4..9: 44,000..49,000
    assert got["steps_logged"] == 9 and got["losses"][0] == pytest.approx(11.9)
    assert got["own_mfu"] == pytest.approx(0.465)
    with pytest.raises(ValueError, match="no step after the warm-up"):
        sbs.titan_figures("\n".join(lines[:3]), warmup=3)


def test_table_mfu_and_ratios():
    per_token, peak = 7.8e9, 989.4
    results = {"torchtitan": {"tokens_per_s": 50_000.0, "what": "tt"}, "megatron": {"tokens_per_s": 60_000.0},
               "fsdp": {"error": "exit 1 after 3 s (see fsdp.log)"}}
    lines = sbs.table(results, per_token, peak)
    assert lines[1].split()[:4] == ["torchtitan", "50,000", f"{50_000 * per_token / peak / 1e12:.1%}", "1.00x"]
    assert lines[2].split()[:4] == ["megatron", "60,000", f"{60_000 * per_token / peak / 1e12:.1%}", "1.20x"]
    assert "exit 1 after 3 s" in lines[3]
    assert lines[-1] == "best of this project's paths: 1.20x torchtitan's tok/s (baseline torchtitan = 1.00x)"


def test_dry_run_prints_the_three_commands_and_writes_torchtitans_config(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_side_by_side.py"), "--dry-run", "--out",
                           str(tmp_path), "--steps", "5", "--warmup", "2"], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = {line.split(":")[0]: line for line in proc.stdout.splitlines()}
    assert "-m torchtitan.train --module hpc_side_by_side_titan --config side_by_side" in lines["torchtitan"]
    layers = "te" if find_spec("transformer_engine") else "sdpa"
    for path in ("megatron", "fsdp"):
        assert f"--backend {path}" in lines[path] and "--size llama-1b --seq 2048 --micro-batch 4 --accum 2 " \
            "--steps 5 --warmup 2" in lines[path]
    assert f"--layers {layers}" in lines["megatron"]
    module = (tmp_path / "hpc_side_by_side_titan.py").read_text()
    compile(module, "hpc_side_by_side_titan.py", "exec")
    assert 'model_registry("1B")' in module and "MICRO_BATCH, ACCUM, SEQ, STEPS, SEED = 4, 2, 2048, 7, 1234" in module
    assert "'dim': 2048" in module and "'vocab_size': 128256" in module and "'tied': True" in module


def test_datasets_stand_in(tmp_path, monkeypatch):
    """Where datasets does not import, torchtitan's path gets a stand-in whose loaders refuse in one line."""
    monkeypatch.setattr(sbs, "find_spec", lambda name: None)
    folder = sbs.datasets_shim(tmp_path / "shims")
    assert sbs.python_path("torchtitan", tmp_path).startswith(str(folder))
    assert not sbs.python_path("fsdp", tmp_path).startswith(str(folder))
    proc = subprocess.run([sys.executable, "-c", "import datasets, datasets.distributed\n"
                           "print(datasets.__file__)\ndatasets.load_dataset('c4')"], capture_output=True, text=True,
                          env={"PYTHONPATH": str(folder)}, timeout=60)
    assert proc.stdout.startswith(str(folder)) and proc.stderr.strip().splitlines()[-1] == (
        "RuntimeError: datasets is not installed: the side-by-side run's stand-in cannot load a data set")


@pytest.mark.skipif(find_spec("torchtitan") is None, reason="torchtitan is not installed (gpu_smoke.sh carries it)")
@pytest.mark.parametrize("stand_in", [False, True], ids=["datasets", "stand-in"])
def test_torchtitans_own_parser_takes_the_generated_config(tmp_path, stand_in):
    """torchtitan 0.3.0's ConfigManager (tyro) parses the module; its tokenizer and loader build and give a batch;
    the model it builds has Llama 3.2 1B's parameter count, the count profiling/flops.py gives the other paths. The
    same with the datasets stand-in first on the path (the GPU machine has no datasets)."""
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_side_by_side.py"), "--dry-run", "--out",
                    str(tmp_path)], check=True, capture_output=True, timeout=300)
    shim = tmp_path / "forced_shim"
    for name, text in sbs.DATASETS_SHIM.items():
        (shim / "datasets").mkdir(parents=True, exist_ok=True)
        (shim / "datasets" / name).write_text(text)
    script = f"""
import json, sys, torch
sys.path.insert(0, {str(tmp_path)!r})
if {stand_in}:
    sys.path.insert(0, {str(shim)!r})
    import datasets
    assert datasets.__file__.startswith({str(shim)!r}), datasets.__file__
from torchtitan.config import ConfigManager
cfg = ConfigManager().parse_args(["--module", "hpc_side_by_side_titan", "--config", "side_by_side"])
tok = cfg.tokenizer.build(tokenizer_path=cfg.hf_assets_path)
loader = cfg.dataloader.build(dp_world_size=1, dp_rank=0, tokenizer=tok, seq_len=cfg.training.seq_len,
                              local_batch_size=cfg.training.local_batch_size, snapshot_every_n_steps=None)
x, y = next(iter(loader))
with torch.device("meta"):
    model = cfg.model_spec.model.build()
print(json.dumps({{"input": list(x["input"].shape), "positions": x["positions"][1, :4].tolist(),
                  "labels": list(y.shape), "shifted": bool((x["input"][:, 1:] == y[:, :-1]).all()),
                  "vocab": tok.get_vocab_size(), "params": sum(p.numel() for p in model.parameters()),
                  "batch": [cfg.training.local_batch_size, cfg.training.global_batch_size, cfg.training.steps],
                  "compile": cfg.compile.enable, "ac": cfg.activation_checkpoint is None,
                  "checkpoint": cfg.checkpoint.enable}}))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"input": [4, 2048], "positions": [0, 1, 2, 3], "labels": [4, 2048], "shifted": True,
                   "vocab": LLAMA_1B["vocab"], "params": LLAMA_1B["params"], "batch": [4, 8, 14], "compile": True,
                   "ac": True, "checkpoint": False}


def test_gpu_mfu_fsdp_dry_run_prints_the_plan(capsys):
    assert gpu_mfu.main(["--backend", "fsdp", "--size", "1.3b", "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("gpu_mfu: Llama 1.3b (24 layers x 2048, 16 heads, vocab 50257), seq 2048, micro 4 x 8, "
                             "bf16, FSDP2 1 rank, compiled blocks")
    assert out[-1].startswith("predicted: step ") and "efficiency 0.35" in out[-1]  # the compiled HF path's


@pytest.mark.slow  # two tiny trainings on the CPU through each backend's own step: about a minute
@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_gpu_mfu_measures_on_the_cpu_and_the_side_by_side_reads_it(backend, tmp_path):
    """gpu_mfu --cpu through each backend, run and read back as the side-by-side runs and reads its paths."""
    extra = ["--no-compile"] if backend == "fsdp" else ["--layers", "sdpa"]
    cmd = [sys.executable, "benchmarks/gpu_mfu.py", "--cpu", "--backend", backend, "--size", "tiny", "--seq", "32",
           "--micro-batch", "2", "--accum", "2", "--steps", "2", "--warmup", "1", "--json",
           str(tmp_path / f"{backend}.json"), *extra]
    got = sbs.run_path(backend, cmd, tmp_path, sbs.parse_args(["--warmup", "1", "--timeout", "600"]))
    assert "error" not in got, got
    m = json.loads((tmp_path / f"{backend}.json").read_text())["measured"]
    assert len(m["losses"]) == 3 and all(5.0 < x < 8.0 for x in m["losses"])  # ~ln(512) from random init
    assert m["tokens_per_s"] == pytest.approx(4 * 32 / m["step_s"]) and m["mfu"] is None
    assert ("FSDP2 full_shard over 1 ranks" if backend == "fsdp" else "attention=sdpa") in m["layer_plan"]
    assert got["tokens_per_s"] == m["tokens_per_s"] and got["losses"] == m["losses"]
    assert got["what"].startswith(m["layer_plan"])


def test_side_by_side_runs_a_path_and_reads_torchtitans_log(tmp_path):
    """A path is a process: its output goes to NAME.log; torchtitan's figures come from that log, a failure is one
    line naming the exit code and the log."""
    args = sbs.parse_args(["--warmup", "1", "--timeout", "60"])
    lines = [titan_line(s, 11.0 - s / 10, 1000.0 * s, None) for s in (1, 2, 3)]
    printer = [sys.executable, "-c", "import sys; print(sys.argv[1])", "\n".join(lines)]
    got = sbs.run_path("torchtitan", printer, tmp_path, args)
    assert (tmp_path / "torchtitan.log").read_text().splitlines() == lines
    assert got["tokens_per_s"] == 2500.0 and got["own_mfu"] is None and got["steps_logged"] == 3
    failed = sbs.run_path("fsdp", [sys.executable, "-c", "raise SystemExit(3)"], tmp_path, args)
    assert failed["error"].startswith("exit 3 after ") and failed["error"].endswith("s (see fsdp.log)")
