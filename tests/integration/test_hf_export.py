"""Megatron <-> Hugging Face: ``checkpoint.init_from_hf``, ``export`` and their round trip, in three layouts.

One launch of 4 gloo ranks (tests/integration/hf_export_driver.py) initialises GPT-2 and LLaMA (GQA) models from
random Hugging Face folders under TP1xPP1 (DP4), TP2xPP2 and PP2xVPP2 (DP2), and a Mixtral (4 experts, top-2) under
TP1xPP1 (DP4) and EP2 x TP2 (+SP), saves step 0, trains 2 steps, saves, and
records the Megatron logits of a fixed batch at both checkpoints. Here, in this process:

- the export of step 0 equals the Hugging Face folder it started from, bit for bit, in every layout (so the round
  trip HF -> Megatron -> HF is exact, and the exports of the three layouts are equal);
- the export of the trained step loads with ``from_pretrained`` with no missing or unexpected keys, and its logits
  equal the Megatron model's within LOGITS_ATOL (fp32, CPU);
- the Megatron logits right after ``init_from_hf`` equal the Hugging Face model's within LOGITS_ATOL;
- bad input: a non-empty --out, a corrupt checkpoint (the previous verified one is exported), no verified checkpoint
  at all: one line, exit 2, nothing written.

LOGITS_ATOL = 1e-5 absolute on logits of magnitude ~1: measured at most 1.4e-6 here (the two implementations differ
only in the order of floating-point sums: fused vs separate QKV, attention kernels).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import hf_export_driver as driver  # noqa: E402

LOGITS_ATOL = 1e-5

pytestmark = [pytest.mark.megatron, pytest.mark.slow]


@pytest.fixture(scope="module")
def driven(tmp_path_factory) -> tuple[Path, dict]:
    work = tmp_path_factory.mktemp("hf_export")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(HERE / "hf_export_driver.py"), "--work", str(work)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = json.loads((work / "results.json").read_text())
    print(f"\nhf export driver: {time.monotonic() - t0:.0f} s for one 4-rank launch, {len(results)} cases")
    return work, results


@pytest.fixture(scope="module")
def tokens(driven):
    import torch

    return torch.load(driven[0] / "tokens.pt")


def export_cli(*args: str) -> int:
    from hpc_tools.cli import main

    return main(["export", *map(str, args)])


def hf_logits(folder: Path, tokens):
    import torch
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    with torch.no_grad():
        return model.eval()(input_ids=tokens).logits, info


def megatron_logits(run: str, step: int):
    import torch

    return torch.load(Path(run) / f"logits_step{step}.pt")[..., :driver.VOCAB]  # the padded rows are not exported


@pytest.mark.parametrize("case", driver.CASES)
def test_round_trip_is_bit_exact(driven, case, tmp_path, capsys):
    """HF -> Megatron (init_from_hf in this layout) -> checkpoint -> export: the same tensors, bit for bit."""
    import torch
    from safetensors.torch import load_file

    work, results = driven
    out = tmp_path / "step0"
    assert export_cli(results[case]["run"], "--out", out, "--step", "0", "--json") == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["step"] == 0 and summary["folder"] == str(out)
    ours = load_file(str(out / "model.safetensors"))
    theirs = load_file(str(work / f"hf_{case.split('-')[0]}" / "model.safetensors"))
    assert ours.keys() == theirs.keys()
    for key in theirs:
        assert ours[key].dtype == theirs[key].dtype == torch.float32
        assert torch.equal(ours[key], theirs[key]), key


@pytest.mark.parametrize("case", driver.CASES)
def test_trained_export_logits_equal_megatron(driven, tokens, case, tmp_path):
    from transformers import GPT2LMHeadModel, LlamaForCausalLM, MixtralForCausalLM

    _, results = driven
    from hpc_tools.hf.export import export_run

    summary = export_run(results[case]["run"], tmp_path / "hf")
    assert summary["step"] == driver.STEPS
    logits, info = hf_logits(tmp_path / "hf", tokens)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    want = megatron_logits(results[case]["run"], driver.STEPS)
    assert logits.shape == want.shape == (driver.BATCH, driver.BASE["model"]["seq_length"], driver.VOCAB)
    diff = (logits - want).abs().max().item()
    print(f"{case}: max |HF - Megatron| logits after {driver.STEPS} steps = {diff:.2e}")
    assert diff <= LOGITS_ATOL
    cls = {"gpt": GPT2LMHeadModel, "llama": LlamaForCausalLM, "mixtral": MixtralForCausalLM}[case.split("-")[0]]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == [cls.__name__]


@pytest.mark.parametrize("case", driver.CASES)
def test_init_from_hf_gives_the_folders_logits(driven, tokens, case):
    work, results = driven
    logits, _ = hf_logits(work / f"hf_{case.split('-')[0]}", tokens)
    diff = (logits - megatron_logits(results[case]["run"], 0)).abs().max().item()
    assert diff <= LOGITS_ATOL, diff


def test_layouts_train_alike_and_resume_wins(driven):
    """The same start in every layout (the losses agree to float32 sum order), and a checkpoint to resume from makes
    init_from_hf step aside."""
    _, results = driven
    for fam in driver.FAMILIES:
        ref = results[f"{fam}-tp1pp1"]["losses"]
        for lay in driver.FAMILY_LAYOUTS[fam]:
            got = results[f"{fam}-{lay}"]["losses"]
            assert max(abs(a - b) for a, b in zip(got, ref)) <= 2e-6, (fam, lay, got, ref)
    assert all(r["declined_on_resume"] for r in results.values())


def test_folder_has_tokenizer_and_generation_config(driven, tmp_path):
    from transformers import AutoTokenizer, GenerationConfig

    from hpc_tools.data.tokenizer import BYTE_EOS_ID, ByteTokenizer
    from hpc_tools.hf.export import EXPORT_META, export_run

    _, results = driven
    export_run(results["llama-tp2pp2"]["run"], tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "Grüße, world!\n\t€ 😀"
    assert tok.encode(text, add_special_tokens=False) == ByteTokenizer().encode(text)
    assert tok.decode(ByteTokenizer().encode(text)) == text
    assert tok.eos_token_id == BYTE_EOS_ID
    assert GenerationConfig.from_pretrained(tmp_path / "hf").eos_token_id == BYTE_EOS_ID
    meta = json.loads((tmp_path / "hf" / EXPORT_META).read_text())
    assert meta["layout"]["tensor_size"] == 2 and meta["layout"]["pipeline_size"] == 2


def test_non_empty_out_needs_overwrite(driven, tmp_path, capsys):
    _, results = driven
    run = results["gpt-tp1pp1"]["run"]
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert export_cli(run, "--out", out) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not empty" in err and "--overwrite" in err
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert export_cli(run, "--out", out, "--overwrite") == 0
    assert (out / "model.safetensors").is_file() and not (out / "keep.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary folder left beside it


def _corrupt(ckpt: Path) -> Path:
    """Flip one byte of the largest shard (same size: only the checksum can tell)."""
    shard = max(ckpt.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    return shard


def test_corrupt_checkpoint_falls_back_then_refuses(driven, tmp_path, capsys):
    from hpc_tools.checkpoints.dirs import dir_name

    _, results = driven
    run = tmp_path / "run"
    shutil.copytree(results["llama-pp2vpp2"]["run"], run)
    shard = _corrupt(run / "checkpoints" / dir_name(driver.STEPS))
    assert export_cli(run, "--out", tmp_path / "a", "--json") == 0
    assert json.loads(capsys.readouterr().out)["step"] == 0  # the newest verified one
    _corrupt(run / "checkpoints" / dir_name(0))
    assert export_cli(run, "--out", tmp_path / "b") == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "no verified checkpoint" in err and shard.name in err, err
    assert not (tmp_path / "b").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "run"]


def test_run_without_checkpoint_is_refused(driven, tmp_path, capsys):
    _, results = driven
    run = tmp_path / "run"
    shutil.copytree(results["gpt-tp1pp1"]["run"], run, ignore=shutil.ignore_patterns("checkpoints"))
    assert export_cli(run, "--out", tmp_path / "hf") == 2
    err = capsys.readouterr().err.strip()
    assert "no verified checkpoint" in err and "complete steps: none" in err, err
    assert not (tmp_path / "hf").exists()
