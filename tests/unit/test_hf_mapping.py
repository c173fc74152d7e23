"""Megatron-core <-> Hugging Face mapping without Megatron: fused layouts, names, configs, refusals, the tokenizer and
the export folder's atomic write (hpc_tools/hf/). The layouts themselves are tests/integration/test_hf_export.py."""

from __future__ import annotations

import json

import pytest

from hpc_tools.errors import UserError
from hpc_tools.recipe.load import resolve

GPT = {"name": "hf_unit", "model": {"family": "gpt", "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                                    "seq_length": 16, "vocab_size": 300},
       "training": {"micro_batch_size": 1, "global_batch_size": 1, "precision": "fp32"},
       "backend": {"kind": "megatron"},
       "cluster": {"nodes": 1, "gpus_per_node": 1, "gpu_type": "cpu"}}


def model(*sets: str):
    return resolve(GPT, list(sets), source="test_hf_mapping").model


LLAMA_SETS = ("model.family=llama", "model.num_query_groups=2", "model.ffn_hidden_size=48")


def test_qkv_split_follows_query_groups():
    """Megatron interleaves per query group [q heads of the group, k, v]; query head j reads key/value head
    j // (heads/groups), as Hugging Face's repeat_kv pairs them."""
    import torch

    from hpc_tools.hf.mapping import merge_qkv, split_qkv

    heads, groups, d = 4, 2, 3
    rows = torch.arange(groups * (heads // groups + 2) * d).float()
    fused = rows.unsqueeze(1).repeat(1, 5)
    q, k, v = split_qkv(fused, heads, groups)
    assert q.shape == (heads * d, 5) and k.shape == v.shape == (groups * d, 5)
    # group 0 rows: q0 (0-2), q1 (3-5), k0 (6-8), v0 (9-11); group 1: q2, q3, k1, v1
    assert q[:, 0].tolist() == [0, 1, 2, 3, 4, 5, 12, 13, 14, 15, 16, 17]
    assert k[:, 0].tolist() == [6, 7, 8, 18, 19, 20] and v[:, 0].tolist() == [9, 10, 11, 21, 22, 23]
    assert torch.equal(merge_qkv(q, k, v, heads, groups), fused)
    assert torch.equal(merge_qkv(*split_qkv(rows, heads, groups), heads, groups), rows)  # biases: 1-D


@pytest.mark.parametrize("sets", [(), ("model.untie_embeddings=true",), LLAMA_SETS,
                                  LLAMA_SETS + ("model.add_bias_linear=true", "model.untie_embeddings=false")],
                         ids=["gpt2-tied", "gpt2-untied", "llama-gqa", "llama-bias-tied"])
def test_hf_megatron_hf_is_exact(sets):
    """A random Hugging Face state dict of each architecture survives HF -> Megatron (padded vocabulary) -> HF."""
    import torch
    from transformers import AutoModelForCausalLM

    from hpc_tools.hf.config import hf_config
    from hpc_tools.hf.mapping import EMBED, QKV, hf_to_megatron, megatron_keys, megatron_to_hf

    recipe = resolve(GPT, list(sets), source="test_hf_mapping")
    m = recipe.model
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(hf_config(recipe), dtype=torch.float32)
    state = {k: torch.randn_like(v) for k, v in hf.state_dict().items()}
    if not m.untie_embeddings:
        state.pop("lm_head.weight")  # tied: not stored (save_pretrained drops it too)
    mc = hf_to_megatron(state, m, padded_vocab=384)
    assert sorted(mc) == sorted(megatron_keys(m))
    assert mc[EMBED].shape == (384, m.hidden_size) and not mc[EMBED][m.vocab_size:].any()
    per_layer = (m.num_attention_heads + 2 * m.num_query_groups) * m.head_dim
    assert mc[QKV + "weight"].shape == (m.num_layers, per_layer, m.hidden_size)
    back = megatron_to_hf(mc, m)
    assert back.keys() == state.keys()
    for key in state:
        assert torch.equal(back[key], state[key]), key
    # and the folder holds exactly the keys Hugging Face expects
    missing, unexpected = hf.load_state_dict(back, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}


def test_gpt2_without_biases_exports_zeros_and_refuses_nonzero():
    import torch

    from hpc_tools.hf.mapping import hf_to_megatron, megatron_to_hf

    m = model("model.add_bias_linear=false")
    with_bias = megatron_to_hf(hf_to_megatron(_random_gpt2(m), m, 384), m)
    assert not with_bias["transformer.h.0.attn.c_attn.bias"].any()
    state = _random_gpt2(m)
    state["transformer.h.1.mlp.c_fc.bias"] = torch.ones_like(state["transformer.h.1.mlp.c_fc.bias"])
    with pytest.raises(UserError, match=r"transformer\.h\.1\.mlp\.c_fc\.bias is nonzero.*add_bias_linear"):
        hf_to_megatron(state, m, 384)


def _random_gpt2(m):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=m.vocab_size, n_positions=m.seq_length, n_embd=m.hidden_size, n_layer=m.num_layers,
                     n_head=m.num_attention_heads, activation_function="gelu")
    state = {k: torch.zeros_like(v) if k.endswith("bias") and ".ln_" not in k else torch.randn_like(v)
             for k, v in GPT2LMHeadModel(cfg).state_dict().items()}
    state.pop("lm_head.weight")
    return state


@pytest.mark.parametrize("sets, field", [
    (("model.position_embedding=rope",), "model.position_embedding=rope"),
    (("model.num_query_groups=2",), "model.num_query_groups=2"),
    (LLAMA_SETS + ("model.normalization=LayerNorm",), "model.normalization=LayerNorm"),
])
def test_inexpressible_models_name_the_field(sets, field):
    from hpc_tools.hf.mapping import architecture

    with pytest.raises(UserError) as err:
        architecture(model(*sets))
    assert str(err.value).startswith(field) and "\n" not in str(err.value)


def _folder(tmp_path, sets=(), **changes):
    """config.json of ``model(*sets)`` as the export writes it, with ``changes``."""
    from hpc_tools.hf.config import hf_config

    cfg = hf_config(resolve(GPT, list(sets), source="test_hf_mapping")).to_dict()
    cfg.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_config_of_the_same_model_is_accepted(tmp_path):
    from hpc_tools.hf.load import read_config

    assert read_config(_folder(tmp_path), model())["n_layer"] == 2
    (tmp_path / "llama").mkdir()
    assert read_config(_folder(tmp_path / "llama", LLAMA_SETS), model(*LLAMA_SETS))["num_key_value_heads"] == 2


@pytest.mark.parametrize("sets, changes, want", [
    (LLAMA_SETS, {}, "model_type=llama (the recipe's model.family=gpt is gpt2)"),
    ((), {"n_layer": 3}, "n_layer=3 (model.num_layers=2 needs 2)"),
    ((), {"activation_function": "gelu_new"}, "activation_function=gelu_new (model.activation=gelu needs gelu)"),
    ((), {"vocab_size": 50257}, "vocab_size=50257 (model.vocab_size=300 needs 300)"),
])
def test_another_architecture_or_shape_is_refused(tmp_path, sets, changes, want):
    from hpc_tools.hf.load import read_config

    folder = _folder(tmp_path, sets, **changes)
    with pytest.raises(UserError) as err:
        read_config(folder, model())
    msg = str(err.value)
    assert msg.startswith(f"checkpoint.init_from_hf: {folder / 'config.json'} has {want}") and "\n" not in msg


def test_llama_shape_mismatch_names_the_field(tmp_path):
    from hpc_tools.hf.load import read_config

    folder = _folder(tmp_path, LLAMA_SETS, num_key_value_heads=4)
    with pytest.raises(UserError, match=r"num_key_value_heads=4 \(model\.num_query_groups=2 needs 2\)"):
        read_config(folder, model(*LLAMA_SETS))


def test_missing_folder_files_are_named(tmp_path):
    from hpc_tools.hf.load import Weights, read_config

    with pytest.raises(UserError, match="config.json does not exist"):
        read_config(tmp_path, model())
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(UserError, match="has no model.safetensors"):
        Weights(tmp_path)


def test_byte_tokenizer_folder_encodes_like_training(tmp_path):
    from transformers import AutoTokenizer

    from hpc_tools.data.tokenizer import BYTE_EOS_ID, BYTE_VOCAB_SIZE, ByteTokenizer
    from hpc_tools.hf.tokenizer import save_tokenizer

    ids = save_tokenizer("byte", tmp_path)
    assert ids["eos_token_id"] == BYTE_EOS_ID
    tok = AutoTokenizer.from_pretrained(tmp_path)
    text = "".join(chr(c) for c in range(1, 400)) + " naïve 漢字 🙂"
    assert tok.encode(text, add_special_tokens=False) == ByteTokenizer().encode(text)
    assert tok.decode(ByteTokenizer().encode(text)) == text
    assert len(tok) == BYTE_VOCAB_SIZE


def test_staged_folder_is_all_or_nothing(tmp_path):
    from hpc_tools.hf.folder import staged

    out = tmp_path / "model"
    with pytest.raises(RuntimeError), staged(out) as tmp:
        (tmp / "half.bin").write_bytes(b"x")
        raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []
    with staged(out) as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(UserError, match="is not empty"), staged(out):
        pass
    with staged(out, overwrite=True) as tmp:
        (tmp / "b").write_text("2")
    assert [p.name for p in out.iterdir()] == ["b"] and [p.name for p in tmp_path.iterdir()] == ["model"]


def test_init_from_hf_is_a_checkpoint_field():
    from hpc_tools.recipe.checkpoint import CheckpointConfig

    assert CheckpointConfig().init_from_hf is None
    assert resolve(GPT, ["checkpoint.init_from_hf=/models/x"]).checkpoint.init_from_hf == "/models/x"


MIXTRAL_SETS = ("model.family=llama", "model.num_query_groups=2", "model.ffn_hidden_size=48", "model.num_experts=4",
                "model.moe_router_topk=2", "model.moe_ffn_hidden_size=40")


def test_mixtral_round_trip_and_config_fields():
    """A Mixtral state dict (the on-disk names) -> Megatron's expert-stacked tensors -> the same state dict."""
    import torch

    from hpc_tools.hf import mapping

    m = model(*MIXTRAL_SETS)
    assert mapping.architecture(m) == mapping.MIXTRAL
    fields = mapping.hf_config_fields(m)
    assert fields["model_type"] == "mixtral" and fields["num_local_experts"] == 4
    assert fields["num_experts_per_tok"] == 2 and fields["intermediate_size"] == 40
    torch.manual_seed(0)
    hf = {}
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        hf[p + "input_layernorm.weight"] = torch.randn(32)
        hf[p + "post_attention_layernorm.weight"] = torch.randn(32)
        hf[p + "self_attn.q_proj.weight"], hf[p + "self_attn.o_proj.weight"] = torch.randn(32, 32), torch.randn(32, 32)
        hf[p + "self_attn.k_proj.weight"], hf[p + "self_attn.v_proj.weight"] = torch.randn(16, 32), torch.randn(16, 32)
        hf[p + "block_sparse_moe.gate.weight"] = torch.randn(4, 32)
        for j in range(4):
            e = p + f"block_sparse_moe.experts.{j}."
            hf[e + "w1.weight"], hf[e + "w3.weight"] = torch.randn(40, 32), torch.randn(40, 32)
            hf[e + "w2.weight"] = torch.randn(32, 40)
    hf["model.embed_tokens.weight"], hf["model.norm.weight"] = torch.randn(300, 32), torch.randn(32)
    hf["lm_head.weight"] = torch.randn(300, 32)
    mc = mapping.hf_to_megatron(hf, m, 384)
    assert mc[mapping.EXPERT_FC1].shape == (2, 4, 80, 32) and mc[mapping.EXPERT_FC2].shape == (2, 4, 32, 40)
    assert torch.equal(mc[mapping.EXPERT_FC1][1, 2, :40], hf["model.layers.1.block_sparse_moe.experts.2.w1.weight"])
    back = mapping.megatron_to_hf(mc, m)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)


@pytest.mark.parametrize("sets, field", [(("model.moe_layer_freq=2",), "moe_layer_freq"),
                                         (("model.moe_shared_expert_intermediate_size=64",),
                                          "moe_shared_expert_intermediate_size"),
                                         (("model.moe_router_score_function=sigmoid",), "moe_router_score_function")])
def test_moe_options_mixtral_lacks_are_refused_naming_the_field(sets, field):
    from hpc_tools.hf import mapping

    with pytest.raises(UserError, match=f"model.{field}=.*MixtralForCausalLM"):
        mapping.architecture(model(*MIXTRAL_SETS, *sets))
