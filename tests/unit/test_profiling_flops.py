"""FLOPs and parameter counts reproduce the published formulas (docs/formulas.md)."""

import math

import pytest

from hpc_tools.recipe.model import ModelConfig
from profiling.flops import flops_per_token, hardware_flops_per_step, model_flops_per_step, num_parameters

# Narayanan et al. 2021, Table 1: (published billions, heads, hidden, layers); V = 51200, s = 2048.
TABLE1 = [(1.7, 24, 2304, 24), (3.6, 32, 3072, 30), (7.5, 32, 4096, 36), (18.4, 48, 6144, 40),
          (39.1, 64, 8192, 48), (76.1, 80, 10240, 60), (145.6, 96, 12288, 80), (310.1, 128, 16384, 96),
          (529.6, 128, 20480, 105), (1008.0, 160, 25600, 128)]


def gpt(layers, hidden, heads, seq=2048, vocab=51200, **kw):
    return ModelConfig(family="gpt", num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                       seq_length=seq, vocab_size=vocab, **kw)


GPT3 = gpt(96, 12288, 96)


@pytest.mark.parametrize("billions,heads,hidden,layers", TABLE1)
def test_parameters_match_narayanan_eq2_and_table1(billions, heads, hidden, layers):
    m = gpt(layers, hidden, heads)
    h, V, s = hidden, 51200, 2048
    eq2 = 12 * layers * h**2 * (1 + 13 / (12 * h) + (V + s) / (12 * layers * h))
    assert num_parameters(m) - 2 * h == pytest.approx(eq2, rel=1e-12)  # eq. 2 leaves out the final norm (2h)
    assert num_parameters(m) / 1e9 == pytest.approx(billions, abs=0.051)  # the table rounds to 0.1 B


def test_gpt3_175b_full_recompute_is_narayanan_eq3_and_34_days():
    B, s, layers, h, V = 1536, 2048, 96, 12288, 51200
    eq3 = 96 * B * s * layers * h**2 * (1 + s / (6 * h) + V / (16 * layers * h))
    got = hardware_flops_per_step(GPT3, B, "full", convention="korthikanti")
    assert got == pytest.approx(eq3, rel=1e-12)
    # The paper: 300 B tokens on 1024 A100 at 140 TFLOP/s each take about 34 days.
    days = got * (300e9 / (B * s)) / (1024 * 140e12) / 86400
    assert 33 < days < 36


@pytest.mark.parametrize("layers,hidden,heads,seq,B", [(96, 12288, 96, 2048, 1536), (24, 2048, 16, 4096, 8),
                                                       (40, 5120, 40, 8192, 3)])
def test_korthikanti_eq7_and_eq8(layers, hidden, heads, seq, B):
    m = gpt(layers, hidden, heads, seq=seq)
    L, s, h, V = layers, seq, hidden, 51200
    eq7 = 72 * B * L * s * h**2 * (1 + s / (6 * h) + V / (12 * h * L))
    eq8 = 72 * B * L * s * h**2 * (1 + s / (3 * h) + V / (12 * h * L))
    assert model_flops_per_step(m, B, convention="korthikanti") == pytest.approx(eq7, rel=1e-12)
    assert hardware_flops_per_step(m, B, "selective", convention="korthikanti") == pytest.approx(eq8, rel=1e-12)
    assert hardware_flops_per_step(m, B, "none", convention="korthikanti") == pytest.approx(eq7, rel=1e-12)


@pytest.mark.parametrize("layers,hidden,heads,seq,V,B", [(24, 2048, 16, 2048, 50257, 256),
                                                         (32, 4096, 32, 4096, 131072, 7)])
def test_megatron_form_halves_causal_attention(layers, hidden, heads, seq, V, B):
    m = gpt(layers, hidden, heads, seq=seq, vocab=V)
    L, s, h = layers, seq, hidden
    expected = 72 * B * s * L * h**2 * (1 + s / (12 * h) + V / (12 * L * h))
    assert model_flops_per_step(m, B) == pytest.approx(expected, rel=1e-12)
    # Full recompute adds exactly one forward of the layers (a third of their fwd+bwd), never of the logits.
    layers_fwd_bwd = expected - 6 * B * s * h * V
    assert hardware_flops_per_step(m, B, "full") == pytest.approx(expected + layers_fwd_bwd / 3, rel=1e-12)
    assert hardware_flops_per_step(m, B, "selective") == pytest.approx(expected + 2 * B * s * L * s * h, rel=1e-12)


def test_llama_gqa_swiglu_untied_counts():
    # TinyLlama-1.1B: 22 layers, h 2048, 32 heads, 4 KV groups, ffn 5632, V 32000, untied, RMSNorm, no biases.
    m = ModelConfig(family="llama", num_layers=22, hidden_size=2048, num_attention_heads=32, num_query_groups=4,
                    ffn_hidden_size=5632, seq_length=2048, vocab_size=32000)
    assert num_parameters(m) == 1_100_048_384  # the published HF checkpoint's parameter count
    h, f, d, s, L, V = 2048, 5632, 64, 2048, 22, 32000
    per_token_fwd = L * (2 * h * (h + 2 * 4 * d) + 2 * h * h + 3 * 2 * h * f + 4 * s * h / 2) + 2 * h * V
    assert model_flops_per_step(m, 4) == pytest.approx(3 * per_token_fwd * 4 * s, rel=1e-12)
    # GQA shrinks the K/V projections only: fewer FLOPs than the same model with MHA.
    mha = m.model_copy(update={"num_query_groups": 32})
    assert model_flops_per_step(m, 1) < model_flops_per_step(mha, 1)
    # Rule of thumb C ~ 6 P D within 15 % for a 1B model at s 2048 (attention and logits make the gap).
    assert flops_per_token(m) / (6 * num_parameters(m)) == pytest.approx(1.0, abs=0.15)


def test_unknown_convention_is_refused():
    with pytest.raises(ValueError, match="convention"):
        model_flops_per_step(GPT3, 1, convention="palm")
    with pytest.raises(ValueError, match="recompute"):
        hardware_flops_per_step(GPT3, 1, "some")
    assert math.isfinite(model_flops_per_step(GPT3, 1))
