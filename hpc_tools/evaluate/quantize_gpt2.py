"""A GPT-2 folder (what Megatron ``model.family: gpt`` runs export) as the same network in ``nn.Linear`` layers, so
that torchao's weight-only schemes, which quantize ``nn.Linear`` only, reach its weights.

Hugging Face's GPT2LMHeadModel keeps every projection in ``Conv1D``: a Linear whose weight is stored transposed
([in, out]). transformers' GPTBigCodeForCausalLM with ``multi_query: false`` is GPT-2 layer for layer -- learned
positions, pre-LayerNorm blocks, the same GELU, attention scaled by 1/sqrt(head_dim), tied output embedding -- in
``nn.Linear``, with one difference of layout: its fused QKV projection is ordered per head ([q_h, k_h, v_h] for each
head h) where GPT-2's is [q (all heads), k, v]. ``to_linear_folder`` writes the GPT-2 folder as a GPTBigCode one:
Conv1D weights transposed, the QKV rows (and bias) permuted, everything else as it is. The result is an ordinary
``from_pretrained`` folder (transformers, lm-eval, the serving job, vLLM's GPTBigCode), so the quantized folder needs
no loader of its own; the logits equal GPT-2's up to float rounding (tests/unit/test_quantize_gpt2.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hpc_tools.errors import UserError

# GPT-2 config keys that change the network in a way GPTBigCode has no switch for (their GPT-2 defaults are False)
UNSUPPORTED = ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention")
# GPT-2 config keys carried over unchanged (same name and meaning in GPTBigCodeConfig)
SHARED = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "activation_function",
          "resid_pdrop", "embd_pdrop", "attn_pdrop", "layer_norm_epsilon", "initializer_range", "scale_attn_weights",
          "use_cache", "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings")
CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def is_gpt2(config: dict[str, Any]) -> bool:
    return config.get("model_type") == "gpt2"


def linear_config(config: dict[str, Any]) -> dict[str, Any]:
    """GPTBigCode's config.json for the GPT-2 ``config`` (a refusal naming the key GPTBigCode cannot express)."""
    bad = [k for k in UNSUPPORTED if config.get(k)]
    if bad:
        raise UserError(f"GPT-2 config {bad[0]}=true has no nn.Linear equivalent in transformers (GPTBigCode): this "
                        "folder cannot be quantized (export the run again with the default GPT-2 attention)")
    out = {k: config[k] for k in SHARED if k in config}
    out.update({"model_type": "gpt_bigcode", "architectures": ["GPTBigCodeForCausalLM"], "multi_query": False,
                "attention_softmax_in_fp32": True, "scale_attention_softmax_in_fp32": True,
                "dtype": config.get("dtype") or config.get("torch_dtype") or "float32"})
    out.setdefault("tie_word_embeddings", True)
    return out


def linear_state(state: dict[str, Any], n_head: int) -> dict[str, Any]:
    """GPT-2's tensors (safetensors names) -> GPTBigCode's: Conv1D weights transposed, the QKV rows per head."""
    out = {}
    for name, tensor in state.items():
        layer = name.rsplit(".", 1)[0]
        if name.endswith((".attn.bias", ".attn.masked_bias")):  # old GPT-2 files: the causal-mask buffers
            continue
        if any(layer.endswith(c) for c in CONV1D) and name.endswith(".weight"):
            tensor = tensor.t()
        if layer.endswith("attn.c_attn"):
            tensor = _per_head(tensor, n_head)
        out[name] = tensor.contiguous()
    return out


def _per_head(tensor, n_head: int):
    """[q | k | v] rows (each n_head x head_dim) -> [q_h, k_h, v_h] for each head h (weight [3E, E] or bias [3E])."""
    three_e = tensor.shape[0]
    head_dim = three_e // (3 * n_head)
    rest = tuple(tensor.shape[1:])
    return tensor.reshape(3, n_head, head_dim, *rest).transpose(0, 1).reshape(three_e, *rest)


def to_linear_folder(src: Path, dst: Path) -> None:
    """Write the GPT-2 folder ``src`` as a GPTBigCode folder ``dst`` (model files only: config.json,
    generation_config.json, model.safetensors)."""
    from safetensors.torch import load_file, save_file

    config = json.loads((src / "config.json").read_text())
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise UserError(f"{src} holds no .safetensors weights (quantize a folder written by `python -m hpc_tools "
                        "export`)")
    state: dict[str, Any] = {}
    for f in files:
        state.update(load_file(str(f)))
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(linear_config(config), indent=2, sort_keys=True))
    if (src / "generation_config.json").is_file():
        (dst / "generation_config.json").write_text((src / "generation_config.json").read_text())
    save_file(linear_state(state, int(config["n_head"])), str(dst / "model.safetensors"), metadata={"format": "pt"})
