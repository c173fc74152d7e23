"""GPT-2 (Conv1D) written as the same network in nn.Linear (transformers' GPTBigCode, ``evaluate.quantize_gpt2``), so
that torchao's weight-only schemes quantize it: the logits are GPT-2's, and a GPT-2 variant GPTBigCode cannot
express is refused in one line before anything is written."""

from __future__ import annotations

import json

import pytest

from hpc_tools.errors import UserError
from hpc_tools.evaluate.quantize_gpt2 import _per_head, linear_config, to_linear_folder


def test_qkv_rows_are_regrouped_per_head():
    import torch

    heads, head_dim, hidden = 3, 2, 6
    rows = torch.arange(3 * hidden)  # [q of heads 0..2 | k | v], head_dim rows each
    got = _per_head(rows, heads).tolist()
    want = [part * hidden + h * head_dim + j for h in range(heads) for part in range(3) for j in range(head_dim)]
    assert got == want
    weight = torch.arange(3 * hidden * 4).reshape(3 * hidden, 4)
    assert _per_head(weight, heads)[:, 0].tolist() == [4 * r for r in want]


@pytest.mark.parametrize("n_inner", [None, 80])
def test_linear_folder_gives_gpt2s_logits_and_greedy_tokens(tmp_path, n_inner):
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=48, n_layer=2, n_head=4,
                                      n_inner=n_inner, initializer_range=0.2)).eval()
    gpt2.save_pretrained(tmp_path / "gpt2")
    to_linear_folder(tmp_path / "gpt2", tmp_path / "linear")
    linear = AutoModelForCausalLM.from_pretrained(str(tmp_path / "linear")).eval()
    assert type(linear).__name__ == "GPTBigCodeForCausalLM"
    assert not [n for n, m in linear.named_modules() if type(m).__name__ == "Conv1D"]
    x = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(gpt2(x).logits, linear(x).logits, atol=1e-5, rtol=0)
        kw = dict(attention_mask=torch.ones_like(x[:1, :5]), max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert gpt2.generate(x[:1, :5], **kw).tolist() == linear.generate(x[:1, :5], **kw).tolist()


def test_a_gpt2_variant_without_a_linear_twin_is_refused(tmp_path):
    config = {"model_type": "gpt2", "n_head": 4, "reorder_and_upcast_attn": True}
    with pytest.raises(UserError) as exc:
        linear_config(config)
    assert "reorder_and_upcast_attn=true" in str(exc.value) and "\n" not in str(exc.value)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text(json.dumps({**config, "reorder_and_upcast_attn": False}))
    with pytest.raises(UserError, match="no .safetensors"):
        to_linear_folder(tmp_path / "src", tmp_path / "out")
    assert not (tmp_path / "out").exists()
