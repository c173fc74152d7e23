"""Parameter counts: Narayanan et al. 2021 eq. 2 for their Table 1 models, agreement with profiling.flops, and the
tensor/pipeline split of the same count."""

from __future__ import annotations

import pytest

from hpc_tools.planner.arch import Arch, pieces, stage_parameters, total_parameters
from hpc_tools.recipe.model import ModelConfig
from profiling.flops import num_parameters

# Narayanan et al. 2021, Table 1: (published billions, heads, hidden, layers); V = 51200, s = 2048.
NARAYANAN_TABLE1 = [(1.7, 24, 2304, 24), (3.6, 32, 3072, 30), (7.5, 32, 4096, 36), (18.4, 48, 6144, 40),
                    (39.1, 64, 8192, 48), (76.1, 80, 10240, 60), (145.6, 96, 12288, 80), (310.1, 128, 16384, 96),
                    (529.6, 128, 20480, 105), (1008.0, 160, 25600, 128)]


def eq2(L: int, h: int, V: int, s: int) -> int:
    """12 L h^2 (1 + 13/(12h) + (V+s)/(12 L h)), multiplied out so that it stays an exact integer."""
    return 12 * L * h * h + 13 * L * h + (V + s) * h


@pytest.mark.parametrize("published, heads, hidden, layers", NARAYANAN_TABLE1)
def test_narayanan_table1(published, heads, hidden, layers):
    m = ModelConfig(family="gpt", num_layers=layers, hidden_size=hidden, num_attention_heads=heads, seq_length=2048,
                    vocab_size=51200)
    planner = total_parameters(Arch.from_model(m))
    # eq. 2 leaves out the final LayerNorm (weight + bias = 2h); 51200 needs no padding for TP up to 8.
    assert planner - 2 * hidden == eq2(layers, hidden, 51200, 2048)
    assert round(planner / 1e9, 1) == published


MODELS = {
    "gpt": dict(family="gpt", num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=512, vocab_size=50257),
    "gpt-untied": dict(family="gpt", num_layers=3, hidden_size=192, num_attention_heads=6, seq_length=128,
                       vocab_size=1000, untie_embeddings=True),
    "llama-gqa": dict(family="llama", num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=2,
                      seq_length=256, vocab_size=32000),
    "llama-tied-bias": dict(family="llama", num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=64,
                            vocab_size=515, untie_embeddings=False, add_bias_linear=True, ffn_hidden_size=320),
}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("tensor", [1, 2, 4])
def test_matches_profiling_num_parameters(name, tensor):
    m = ModelConfig(**MODELS[name])
    arch = Arch.from_model(m)
    padded = m.padded_vocab_size(tensor)
    assert arch.padded_vocab(tensor) == padded
    whole = pieces(arch, 1)
    assert total_parameters(arch) == num_parameters(m, vocab_size=m.padded_vocab_size(1))
    # the same model with the vocabulary padded for TP `tensor`
    grown = (padded - m.padded_vocab_size(1)) * m.hidden_size * (1 if arch.tied else 2)
    assert total_parameters(arch) + grown == num_parameters(m, vocab_size=padded)
    assert whole.layer * m.num_layers < total_parameters(arch)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("tensor", [2, 4])
def test_tensor_sharding_replicates_only_norms_and_row_biases(name, tensor):
    m = ModelConfig(**MODELS[name])
    arch = Arch.from_model(m)
    replicated = 2 * arch.norm_params_per_h * m.hidden_size + (2 * m.hidden_size if arch.bias else 0)
    assert pieces(arch, tensor).layer * tensor - pieces(arch, 1).layer == (tensor - 1) * replicated


@pytest.mark.parametrize("name", list(MODELS))
def test_pipeline_stages_add_up(name):
    m = ModelConfig(**MODELS[name])
    arch = Arch.from_model(m)
    for pipeline in [p for p in (1, 2, 3, 4) if m.num_layers % p == 0]:
        stages = sum(stage_parameters(arch, 1, pipeline, s) for s in range(pipeline))
        # tied embeddings with p > 1: the last stage holds its own copy of the word embedding
        copy = pieces(arch, 1).word_embedding if arch.tied and pipeline > 1 else 0
        assert stages == total_parameters(arch) + copy, pipeline
