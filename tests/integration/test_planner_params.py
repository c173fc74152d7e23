"""The planner's parameter count equals the count of the real models the jobs build from the same recipe.

One child process (this file run as a script) builds, from each recipe: Megatron-core's GPTModel with the local layer
spec in a single-process gloo group (parallel_state TP1/PP1, vocabulary padded as the Megatron job pads it), and the
Hugging Face GPT2LMHeadModel / LlamaForCausalLM from a config mirroring the recipe (vocabulary as the DeepSpeed job
uses it, unpadded). Parameters are counted with ``model.parameters()`` (tied weights once).
The same child also runs one real Megatron-core TransformerLayer (local spec, bf16, explicit attention as on CPU)
forward and sums the bytes autograd saves for backward (saved_tensors_hooks, each storage once, weights and the
shared causal mask left out): it must equal the planner's per-layer activation bytes plus the LayerNorm statistics
the planner states it leaves out.
Also: ``python -m hpc_tools plan`` (and ``--search``) never imports torch, megatron, deepspeed or transformers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# (case, recipe, --set overrides) -- all with the recipe's local profile: tiny models, CPU.
CASES = [
    ("gpt tied, learned positions", "recipes/gpt_3d.yaml", []),
    ("gpt untied, padded vocab", "recipes/gpt_3d.yaml", ["model.vocab_size=50257", "model.untie_embeddings=true"]),
    ("llama GQA untied", "recipes/gpt_zero.yaml", []),
    ("llama MHA tied, 3 layers", "recipes/gpt_zero.yaml",
     ["model.num_query_groups=null", "model.untie_embeddings=false", "model.num_layers=3", "model.vocab_size=1000"]),
    ("llama as gpt family", "recipes/gpt_zero.yaml",
     ["model.family=gpt", "model.num_query_groups=null", "model.ffn_hidden_size=null"]),
]

# Megatron only (experts): the MoE recipe's local profile (4 experts, top-2), and with a shared expert, an expert width
# of its own and a per-layer moe_layer_freq list. Built with the allgather dispatcher (the same parameters as alltoall,
# whose constructor wants CUDA streams).
MOE_CASES = [
    ("moe 4 experts top-2", "recipes/gpt_moe.yaml", []),
    ("moe shared expert, freq list", "recipes/gpt_moe.yaml",
     ["model.num_layers=4", "model.moe_layer_freq=[0, 1, 0, 1]", "model.moe_ffn_hidden_size=48",
      "model.moe_shared_expert_intermediate_size=96"]),
]

# (case, s, b, h, heads, query groups, ffn, swiglu) for the activation check; dropout 0 as in the shipped recipes
# (CPU dropout saves a 16-bit noise tensor where CUDA's saves a 1-byte mask).
LAYERS = [("gpt MHA GELU", 128, 2, 256, 8, 8, 1024, False), ("GQA SwiGLU", 64, 3, 256, 8, 2, 704, True)]


def _load(recipe: str, overrides: list[str], backend: str):
    from hpc_tools.recipe.load import load_recipe

    return load_recipe(REPO / recipe, overrides + [f"backend.kind={backend}"], profile="local", check=False)


# --- child process: build the real models ---------------------------------------------------------------------------

def _megatron_count(recipe) -> int:
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    m = recipe.model
    moe = {} if m.num_experts is None else dict(
        num_moe_experts=m.num_experts, moe_router_topk=m.moe_router_topk, moe_ffn_hidden_size=m.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size, moe_layer_freq=m.moe_layer_freq,
        moe_grouped_gemm=False, moe_token_dispatcher_type="allgather")
    cfg = TransformerConfig(**moe, num_layers=m.num_layers, hidden_size=m.hidden_size,
                            num_attention_heads=m.num_attention_heads, num_query_groups=m.num_query_groups,
                            ffn_hidden_size=m.ffn_hidden_size,
                            kv_channels=m.head_dim, normalization=m.normalization, add_bias_linear=m.add_bias_linear,
                            gated_linear_unit=m.activation == "swiglu",
                            activation_func=F.silu if m.activation == "swiglu" else F.gelu,
                            use_cpu_initialization=True, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                            bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
                            gradient_accumulation_fusion=False, apply_rope_fusion=False, persist_layer_norm=False)
    spec = (get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization=m.normalization) if moe
            else get_gpt_layer_local_spec(normalization=m.normalization))
    model = GPTModel(config=cfg, transformer_layer_spec=spec,
                     vocab_size=m.padded_vocab_size(1), max_sequence_length=m.seq_length,
                     position_embedding_type=m.position_embedding, rotary_base=m.rotary_base,
                     share_embeddings_and_output_weights=not m.untie_embeddings)
    return sum(p.numel() for p in model.parameters())


def _hf_count(recipe) -> int:
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    m = recipe.model
    common = dict(vocab_size=m.vocab_size, tie_word_embeddings=not m.untie_embeddings)
    if m.family == "gpt":
        cfg = GPT2Config(n_positions=m.seq_length, n_embd=m.hidden_size, n_layer=m.num_layers,
                         n_head=m.num_attention_heads, n_inner=m.ffn_hidden_size, **common)
    else:
        cfg = LlamaConfig(hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
                          num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
                          num_key_value_heads=m.num_query_groups,
                          max_position_embeddings=m.seq_length, attention_bias=m.add_bias_linear,
                          mlp_bias=m.add_bias_linear, **common)
    model = AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


def _layer_saved_bytes(s: int, b: int, h: int, a: int, g: int, f: int, swiglu: bool) -> dict:
    import torch
    import torch.nn.functional as F
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from hpc_tools.train.megatron import cpu_compat

    cpu_compat.install()  # Megatron's CUDA-only calls routed to the CPU (docs/megatron-on-cpu.md)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    # the trainer's settings that change what is saved: fp32 softmax, no bias-activation fusion
    cfg = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=a, num_query_groups=g, ffn_hidden_size=f,
                            gated_linear_unit=swiglu, activation_func=F.silu if swiglu else F.gelu,
                            add_bias_linear=not swiglu, hidden_dropout=0.0, attention_dropout=0.0,
                            use_cpu_initialization=True, params_dtype=torch.bfloat16, bf16=True,
                            attention_softmax_in_fp32=True, bias_activation_fusion=False, masked_softmax_fusion=False,
                            bias_dropout_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
                            normalization="LayerNorm")
    layer = build_module(get_gpt_layer_local_spec(normalization="LayerNorm"), config=cfg, layer_number=1)
    x = torch.randn(s, b, h, dtype=torch.bfloat16, requires_grad=True)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    skip = {p.untyped_storage().data_ptr() for p in layer.parameters()} | {mask.untyped_storage().data_ptr()}
    saved: dict[int, tuple[int, tuple]] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, attention_mask=mask)
    kept = {ptr: v for ptr, v in saved.items() if ptr not in skip}
    stats = sum(n for n, shape in kept.values() if shape[-1:] == (1,))  # LayerNorm mean / rstd per token
    return {"saved": sum(n for n, _ in kept.values()), "norm_stats": stats}


def child() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from hpc_tools.runtime.distenv import join_world

    join_world("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    out = {}
    for name, recipe, overrides in CASES:
        out[name] = {"megatron": _megatron_count(_load(recipe, overrides, "megatron")),
                     "hf": _hf_count(_load(recipe, overrides, "deepspeed"))}
    for name, recipe, overrides in MOE_CASES:
        out[name] = {"megatron": _megatron_count(_load(recipe, overrides, "megatron"))}
    layers = {case[0]: _layer_saved_bytes(*case[1:]) for case in LAYERS}
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    print("COUNTS " + json.dumps({"models": out, "layers": layers}))


# --- the test -------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real_counts() -> dict:
    from hpc_tools.testing.spawn import spawn_ranks

    [child_rank] = spawn_ranks([sys.executable, __file__], 1, env={"HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu"},
                               timeout_s=300)
    lines = [line for line in child_rank.log.splitlines() if line.startswith("COUNTS ")]
    assert child_rank.ok and lines, child_rank.log[-3000:]
    return json.loads(lines[-1].removeprefix("COUNTS "))


@pytest.mark.megatron
@pytest.mark.parametrize("name, recipe, overrides", CASES, ids=[c[0] for c in CASES])
def test_planner_counts_equal_real_models(real_counts, name, recipe, overrides):
    from hpc_tools.planner.arch import arch_for, total_parameters
    from profiling.flops import num_parameters

    megatron, deepspeed = _load(recipe, overrides, "megatron"), _load(recipe, overrides, "deepspeed")
    real = real_counts["models"][name]
    assert total_parameters(arch_for(megatron)) == real["megatron"]
    assert total_parameters(arch_for(deepspeed)) == real["hf"]
    # and profiling.flops (the owner of parameter counts) agrees, over the vocabulary each job allocates
    assert num_parameters(megatron.model, vocab_size=megatron.model.padded_vocab_size(1)) == real["megatron"]
    assert num_parameters(deepspeed.model) == real["hf"]


@pytest.mark.megatron
@pytest.mark.parametrize("name, recipe, overrides", MOE_CASES, ids=[c[0] for c in MOE_CASES])
def test_moe_counts_equal_megatrons_moe_model(real_counts, name, recipe, overrides):
    """Router, routed experts, shared expert, dense layers of a moe_layer_freq list: profiling.flops and the
    planner's pieces count what Megatron-core's MoE GPT allocates."""
    from hpc_tools.planner.arch import arch_for, total_parameters
    from profiling.flops import num_parameters

    megatron = _load(recipe, overrides, "megatron")
    real = real_counts["models"][name]["megatron"]
    assert num_parameters(megatron.model, vocab_size=megatron.model.padded_vocab_size(1)) == real
    assert total_parameters(arch_for(megatron)) == real


@pytest.mark.megatron
@pytest.mark.parametrize("name, s, b, h, a, g, f, swiglu", LAYERS, ids=[c[0] for c in LAYERS])
def test_layer_activations_equal_what_autograd_saves(real_counts, name, s, b, h, a, g, f, swiglu):
    from hpc_tools.planner.memory import layer_activation_bytes

    measured = real_counts["layers"][name]
    predicted = layer_activation_bytes(s, b, h, a, 1, groups=g, ffn=f, gated=swiglu, flash=False, hidden_dropout=False,
                                       attention_dropout=False, softmax_fp32=True, glu_offset_copy=swiglu,
                                       expand_kv=True)
    assert measured["norm_stats"] == 2 * 2 * 4 * s * b  # two LayerNorms, fp32 mean and rstd per token
    assert measured["saved"] - measured["norm_stats"] == predicted


def test_plan_command_never_imports_torch():
    code = ("import json, sys\nfrom hpc_tools.cli import main\n"
            "rcs = [main(['plan', 'recipes/gpt_3d.yaml', '--json']), "
            "main(['plan', 'recipes/gpt_zero.yaml', '--search', '--json', '--no-calibration'])]\n"
            "heavy = sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('torch', 'megatron', 'deepspeed', 'transformers'))\n"
            "print('RESULT ' + json.dumps({'rcs': rcs, 'heavy': heavy}))\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "HPC_TOOLS_CALIBRATION": "/nonexistent/calibration.json"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["rcs"] == [0, 0]
    assert result["heavy"] == []


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    child()
