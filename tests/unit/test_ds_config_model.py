"""model: -> the Hugging Face config of the DeepSpeed job, and the mixes it refuses (one line naming the field)."""

from __future__ import annotations

import pytest

from hpc_tools.errors import UserError
from hpc_tools.hf.config import hf_config
from hpc_tools.recipe.load import resolve
from hpc_tools.train.hf_causal_lm import initial_value


def recipe(model=None, training=None):
    base = {"family": "llama", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
            "ffn_hidden_size": 176, "seq_length": 64, "vocab_size": 512}
    return resolve({"name": "m", "model": {**base, **(model or {})}, "training": training or {},
                    "backend": {"kind": "deepspeed"}, "cluster": {"gpus_per_node": 1, "gpu_type": "cpu"}})


def test_llama_config_carries_gqa_ffn_rope_and_untied_head():
    cfg = hf_config(recipe(model={"rotary_base": 500000, "norm_epsilon": 1e-6}))
    assert type(cfg).__name__ == "LlamaConfig"
    assert (cfg.num_key_value_heads, cfg.num_attention_heads, cfg.intermediate_size) == (2, 4, 176)
    assert cfg.rope_parameters["rope_theta"] == 500000 and cfg.rms_norm_eps == 1e-6
    assert cfg.tie_word_embeddings is False and cfg.hidden_act == "silu" and cfg.max_position_embeddings == 64
    assert cfg.eos_token_id == 256  # the byte tokenizer's EOS


def test_gpt_config_is_gpt2_with_tied_embeddings():
    cfg = hf_config(recipe(model={"family": "gpt", "num_query_groups": None, "ffn_hidden_size": None,
                                  "hidden_dropout": 0.1}))
    assert type(cfg).__name__ == "GPT2Config"
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_inner, cfg.n_positions) == (2, 64, 4, 256, 64)
    assert cfg.tie_word_embeddings is True and cfg.resid_pdrop == 0.1 and cfg.activation_function == "gelu"


@pytest.mark.parametrize("model,training,match", [
    ({"family": "gpt"}, None, r"model.num_query_groups=2 needs model.family=llama"),
    ({"family": "gpt", "num_query_groups": None, "normalization": "RMSNorm"}, None,
     r"model.normalization=RMSNorm is not available for model.family=gpt"),
    ({"activation": "gelu"}, None, r"model.activation=gelu is not available for model.family=llama"),
    ({"hidden_dropout": 0.1}, None, r"model.hidden_dropout=0.1 is not available"),
    (None, {"recompute_granularity": "selective"},
     r"training.recompute_granularity=selective is not available with backend.kind=deepspeed"),
])
def test_inexpressible_models_are_refused(model, training, match):
    with pytest.raises(UserError, match=match):
        hf_config(recipe(model=model, training=training))


def test_initial_values_depend_on_name_and_seed_only():
    a = initial_value("model.layers.0.mlp.up_proj.weight", (8, 4), 0.02, "weight", 1, 2)
    assert a.equal(initial_value("model.layers.0.mlp.up_proj.weight", (8, 4), 0.02, "weight", 1, 2))
    assert not a.equal(initial_value("model.layers.1.mlp.up_proj.weight", (8, 4), 0.02, "weight", 1, 2))
    assert not a.equal(initial_value("model.layers.0.mlp.up_proj.weight", (8, 4), 0.02, "weight", 2, 2))
    big = initial_value("w", (256, 256), 0.02, "weight", 1, 2)
    assert abs(big.std().item() - 0.02) < 0.001
    proj = initial_value("transformer.h.0.attn.c_proj.weight", (256, 256), 0.02, "weight", 1, 8)
    assert abs(proj.std().item() - 0.02 / 4) < 0.0005  # GPT-2 residual projections: std / sqrt(2 L)
    assert initial_value("model.norm.weight", (4,), 0.02, "norm", 1, 2).eq(1).all()
    assert initial_value("transformer.h.0.attn.c_attn.bias", (4,), 0.02, "weight", 1, 2).eq(0).all()
