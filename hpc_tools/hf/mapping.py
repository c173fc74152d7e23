"""Megatron-core <-> Hugging Face weights: names, fused layouts and configs (docs/hf-conversion.md).

Both directions work on *global* tensors keyed by Megatron-core's checkpoint keys, the keys of
``GPTModel.sharded_state_dict()`` that a torch_dist checkpoint stores. Those keys do not depend on the layout:
tensor-parallel shards are slices of one global tensor, and the layers of every pipeline (and virtual pipeline) stage
are rows of one tensor stacked over the layers (``decoder.layers.<name>`` of shape ``[num_layers, ...]``). They
depend on the layer spec in one place (``layers``: the layer kind a checkpoint's meta records, ``transformer_engine``
or ``local``): Megatron stores the norms in front of attention and the MLP under the Transformer Engine names
(``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``) whether the layer fuses them (TE spec) or keeps
them separate (local spec: ``input_layernorm``, ``pre_mlp_layernorm``, renamed by the spec's
``sharded_state_dict_keys_map``), except the MoE layer's pre-MLP norm under TE: megatron-core's TE spec gives an MoE
layer its own ``pre_mlp_layernorm`` (``TENorm``; there is no ``linear_fc1`` to fuse it into) and no key map, so it is
stored as ``pre_mlp_layernorm.weight`` (``norm2_prefix``). Multi-latent attention has no Hugging Face class here
(``architecture`` refuses it).

Fused layouts undone here:

- ``linear_qkv``: ``[groups * (heads/groups + 2) * head_dim, hidden]``, interleaved per query group: for each group
  its query heads, then its key head, then its value head.
- ``linear_fc1`` with SwiGLU: ``[2 * ffn, hidden]``, the gate half first, then the up half (Megatron stores the two
  halves as separate global tensors whatever the tensor-parallel size).
- The vocabulary: Megatron pads the embedding (and output layer) rows to a multiple of 128 x tensor_size; Hugging
  Face gets ``model.vocab_size`` rows, and an import fills the padded rows with zeros.

The architectures (``architecture``): GPT-2 (``GPT2LMHeadModel``: LayerNorm, GELU, learned positions; its Conv1D
weights are stored transposed), LLaMA (``LlamaForCausalLM``: RMSNorm, SwiGLU, RoPE, grouped-query attention) and
Mixtral (``MixtralForCausalLM``: LLaMA's attention with a mixture of SwiGLU experts in every layer). Mixtral's folder
format (what ``save_pretrained`` writes and every published Mixtral checkpoint has): per layer
``block_sparse_moe.gate.weight`` ``[experts, hidden]`` (Megatron's ``mlp.router.weight``) and per expert ``j``
``block_sparse_moe.experts.j.w1`` (gate), ``w3`` (up), ``w2`` (down); Megatron stacks the experts in
``mlp.experts.experts.linear_fc1.weight`` ``[layers, experts, 2 * moe_ffn, hidden]`` (gate half first) and
``linear_fc2.weight`` ``[layers, experts, hidden, moe_ffn]``. Both route with a softmax over the experts, keep the
top k and renormalise their weights (megatron-core's softmax after top-k).
Torch is imported by the functions that need it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from hpc_tools.errors import UserError

if TYPE_CHECKING:
    import torch

    from hpc_tools.recipe.model import ModelConfig

GPT2, LLAMA, MIXTRAL = "gpt2", "llama", "mixtral"
ARCHITECTURES = {GPT2: "GPT2LMHeadModel", LLAMA: "LlamaForCausalLM", MIXTRAL: "MixtralForCausalLM"}

# Megatron-core checkpoint keys (global tensors). LAYER keys are stacked over the layers: [num_layers, ...].
EMBED = "embedding.word_embeddings.weight"
POSITIONS = "embedding.position_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm."
OUTPUT = "output_layer.weight"
LAYER = "decoder.layers."
NORM1 = LAYER + "self_attention.linear_qkv.layer_norm_"
QKV = LAYER + "self_attention.linear_qkv."
PROJ = LAYER + "self_attention.linear_proj."
NORM2 = LAYER + "mlp.linear_fc1.layer_norm_"
TE_MOE_NORM2 = LAYER + "pre_mlp_layernorm."  # the MoE layer's own TENorm under Transformer Engine layers
TE_LAYERS, LOCAL_LAYERS = "transformer_engine", "local"
"""The layer kinds (``train.megatron.layers.LayerPlan.layers``, recorded in a checkpoint's meta as ``layers``)."""
FC1 = LAYER + "mlp.linear_fc1."
FC2 = LAYER + "mlp.linear_fc2."
ROUTER = LAYER + "mlp.router.weight"
EXPERT_FC1 = LAYER + "mlp.experts.experts.linear_fc1.weight"  # [layers, experts, 2 * moe_ffn, hidden]
EXPERT_FC2 = LAYER + "mlp.experts.experts.linear_fc2.weight"  # [layers, experts, hidden, moe_ffn]
EXPERT_KEYS = (ROUTER, EXPERT_FC1, EXPERT_FC2)
"""Checkpoint keys stacked over layers and experts (two leading axes) besides the router's."""
MIXTRAL_SHAPE = {"family": "llama", "moe_layer_freq": 1, "moe_shared_expert_intermediate_size": None,
                 "moe_router_score_function": "softmax", "moe_router_enable_expert_bias": False,
                 "multi_latent_attention": False, "add_bias_linear": False}
"""What Mixtral's class expresses of the MoE fields: every layer a MoE layer, no shared expert, softmax routing,
standard attention, no biases."""


def architecture(m: "ModelConfig") -> str:
    """The Hugging Face architecture of a recipe's ``model:`` section, or a UserError naming the field to change.

    The combinations each Hugging Face class expresses are those of ``recipe.rules.HF_FAMILY_SHAPE`` (the same the
    DeepSpeed backend builds); linear layers without biases export to GPT-2 as zero biases."""
    from hpc_tools.recipe.rules import HF_FAMILY_SHAPE

    if m.num_experts is not None:
        for key, needed in MIXTRAL_SHAPE.items():
            if getattr(m, key) != needed:
                raise UserError(f"model.{key}={getattr(m, key)} has no Hugging Face equivalent for a mixture of "
                                f"experts ({ARCHITECTURES[MIXTRAL]} uses {key}={needed}; train with that to "
                                "export or import it)")
    if m.multi_latent_attention:
        raise UserError("model.multi_latent_attention=true has no Hugging Face equivalent (GPT-2 and LLaMA project "
                        "queries, keys and values directly; train with multi_latent_attention: false to export or "
                        "import it)")
    arch = GPT2 if m.family == "gpt" else LLAMA
    for key, needed in HF_FAMILY_SHAPE[m.family].items():
        if getattr(m, key) != needed:
            raise UserError(f"model.{key}={getattr(m, key)} has no Hugging Face equivalent for model.family="
                            f"{m.family} ({ARCHITECTURES[arch]} uses {key}={needed}; train with that, or with the "
                            "other family)")
    if arch == GPT2 and m.num_query_groups != m.num_attention_heads:
        raise UserError(f"model.num_query_groups={m.num_query_groups} has no Hugging Face equivalent for "
                        "model.family=gpt (GPT-2 has plain multi-head attention; use family: llama for grouped "
                        "queries)")
    return MIXTRAL if m.num_experts is not None else arch


def hf_config_fields(m: "ModelConfig") -> dict[str, Any]:
    """The config.json fields that fix the shape and the numerics of the model, as ``model:`` implies them.

    An imported folder must agree on each (``config_mismatches``); the export writes them (through
    ``hpc_tools.hf.config.hf_config``, the one recipe -> transformers config)."""
    tied = not m.untie_embeddings
    if architecture(m) == GPT2:
        return {"model_type": GPT2, "vocab_size": m.vocab_size, "n_positions": m.seq_length, "n_embd": m.hidden_size,
                "n_layer": m.num_layers, "n_head": m.num_attention_heads, "n_inner": m.ffn_hidden_size,
                "activation_function": "gelu", "layer_norm_epsilon": m.norm_epsilon, "tie_word_embeddings": tied}
    if architecture(m) == MIXTRAL:
        return {"model_type": MIXTRAL, "vocab_size": m.vocab_size, "hidden_size": m.hidden_size,
                "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_attention_heads,
                "num_key_value_heads": m.num_query_groups, "head_dim": m.head_dim,
                "intermediate_size": m.moe_ffn_hidden_size, "num_local_experts": m.num_experts,
                "num_experts_per_tok": m.moe_router_topk, "hidden_act": "silu", "rms_norm_eps": m.norm_epsilon,
                "rope_theta": float(m.rotary_base), "tie_word_embeddings": tied}
    return {"model_type": LLAMA, "vocab_size": m.vocab_size, "hidden_size": m.hidden_size,
            "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_attention_heads,
            "num_key_value_heads": m.num_query_groups, "head_dim": m.head_dim, "intermediate_size": m.ffn_hidden_size,
            "hidden_act": "silu", "rms_norm_eps": m.norm_epsilon, "rope_theta": float(m.rotary_base),
            "attention_bias": m.add_bias_linear, "mlp_bias": m.add_bias_linear, "tie_word_embeddings": tied}


def _config_value(config: dict[str, Any], key: str) -> Any:
    """A config.json value with the defaults transformers applies when a field is absent."""
    if key == "n_inner" and config.get("n_inner") is None:
        return 4 * config.get("n_embd", 768)
    if key == "head_dim" and config.get("head_dim") is None:
        return config.get("hidden_size", 0) // max(config.get("num_attention_heads", 1), 1)
    if key == "num_key_value_heads" and config.get("num_key_value_heads") is None:
        return config.get("num_attention_heads")
    if key == "rope_theta":
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if rope.get("rope_type", "default") != "default":
            return f"rope_type {rope.get('rope_type')}"
        theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        return float(theta)
    if key == "tie_word_embeddings":  # the class defaults: GPT-2 ties, LLaMA does not
        return config.get(key, config.get("model_type") == GPT2)
    if key in ("attention_bias", "mlp_bias"):
        return config.get(key, False)
    return config.get(key)


RECIPE_FIELD = {"vocab_size": "vocab_size", "n_positions": "seq_length", "n_embd": "hidden_size",
                "n_layer": "num_layers", "n_head": "num_attention_heads", "n_inner": "ffn_hidden_size",
                "activation_function": "activation", "layer_norm_epsilon": "norm_epsilon",
                "tie_word_embeddings": "untie_embeddings", "hidden_size": "hidden_size",
                "num_hidden_layers": "num_layers", "num_attention_heads": "num_attention_heads",
                "num_key_value_heads": "num_query_groups", "head_dim": "hidden_size",
                "intermediate_size": "ffn_hidden_size", "hidden_act": "activation", "rms_norm_eps": "norm_epsilon",
                "rope_theta": "rotary_base", "attention_bias": "add_bias_linear", "mlp_bias": "add_bias_linear",
                "num_local_experts": "num_experts", "num_experts_per_tok": "moe_router_topk"}
"""The ``model:`` field that sets each config.json field (named in the error of a mismatch)."""


def config_mismatches(config: dict[str, Any], m: "ModelConfig") -> list[str]:
    """``field=value`` notes for each config.json field that disagrees with ``model:`` (empty: same model)."""
    want = hf_config_fields(m)
    if config.get("model_type") != want["model_type"]:
        return [f"model_type={config.get('model_type')} (the recipe's model.family={m.family} is "
                f"{want['model_type']})"]
    out = []
    for key, value in want.items():
        got = _config_value(config, key)
        if got != value:
            field = "moe_ffn_hidden_size" if key == "intermediate_size" and m.num_experts is not None \
                else RECIPE_FIELD[key]
            out.append(f"{key}={got} (model.{field}={getattr(m, field)} needs {value})")
    return out


# -- tensors -----------------------------------------------------------------------------------------------------------

def split_qkv(w: "torch.Tensor", heads: int, groups: int) -> tuple["torch.Tensor", ...]:
    """Megatron's fused QKV weight ``[groups*(heads/groups+2)*d, ...]`` (or its bias) -> (q, k, v), each with the
    heads in order (query head j belongs to group j // (heads/groups), as in Hugging Face's repeat_kv)."""
    per = heads // groups
    rest = w.shape[1:]
    d = w.shape[0] // (groups * (per + 2))
    g = w.reshape(groups, per + 2, d, *rest)
    q = g[:, :per].reshape(heads * d, *rest)
    k = g[:, per].reshape(groups * d, *rest)
    v = g[:, per + 1].reshape(groups * d, *rest)
    return q.clone(), k.clone(), v.clone()


def merge_qkv(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", heads: int, groups: int) -> "torch.Tensor":
    """The inverse of ``split_qkv``."""
    import torch

    per = heads // groups
    rest = q.shape[1:]
    d = q.shape[0] // heads
    fused = torch.cat([q.reshape(groups, per, d, *rest), k.reshape(groups, 1, d, *rest),
                       v.reshape(groups, 1, d, *rest)], dim=1)
    return fused.reshape(groups * (per + 2) * d, *rest)


def norm2_prefix(m: "ModelConfig", layers: str) -> str:
    """The checkpoint key prefix of the norm in front of the MLP for the layer kind ``layers``: the MoE layer's own
    ``pre_mlp_layernorm`` under Transformer Engine, else the name fused into ``linear_fc1`` (module docstring)."""
    if layers not in (TE_LAYERS, LOCAL_LAYERS):
        raise ValueError(f"layer kind {layers!r}")
    return TE_MOE_NORM2 if layers == TE_LAYERS and m.num_experts is not None else NORM2


def megatron_keys(m: "ModelConfig", layers: str = LOCAL_LAYERS) -> list[str]:
    """The checkpoint keys of ``model:``'s GPTModel built with ``layers`` (``transformer_engine`` | ``local``): what
    an export reads, what an import fills."""
    bias = m.add_bias_linear
    norm = ["weight", "bias"] if m.normalization == "LayerNorm" else ["weight"]
    keys = [EMBED] + ([POSITIONS] if m.position_embedding == "learned_absolute" else [])
    norm2 = norm2_prefix(m, layers)
    keys += [NORM1 + n for n in norm] + [norm2 + n for n in norm] + [FINAL_NORM + n for n in norm]
    for linear in (QKV, PROJ) if m.num_experts is not None else (QKV, PROJ, FC1, FC2):
        keys += [linear + "weight"] + ([linear + "bias"] if bias else [])
    if m.num_experts is not None:
        keys += list(EXPERT_KEYS)
    return keys + ([OUTPUT] if m.untie_embeddings else [])


def _c(t: "torch.Tensor") -> "torch.Tensor":
    """A contiguous tensor with its own storage (safetensors refuses views of shared storage)."""
    return t.contiguous().clone()


def megatron_to_hf(mc: dict[str, "torch.Tensor"], m: "ModelConfig", layers: str = LOCAL_LAYERS
                   ) -> dict[str, "torch.Tensor"]:
    """Global Megatron-core tensors of a model built with ``layers`` -> Hugging Face state dict (as
    ``save_pretrained`` writes it: a tied output projection is not stored)."""
    arch, V = architecture(m), m.vocab_size
    missing = [k for k in megatron_keys(m, layers) if k not in mc]
    if missing:
        raise KeyError(f"missing Megatron tensors {missing[:4]}")
    norm2 = norm2_prefix(m, layers)  # NORM2, or the TE MoE layer's own norm
    layer_to_hf = {MIXTRAL: _mixtral_layer_to_hf, GPT2: _gpt2_layer_to_hf}.get(arch, _llama_layer_to_hf)
    out: dict[str, "torch.Tensor"] = {}
    for i in range(m.num_layers):
        layer_to_hf(out, mc, m, i, norm2)
    if arch == GPT2:
        out["transformer.wte.weight"] = _c(mc[EMBED][:V])
        out["transformer.wpe.weight"] = _c(mc[POSITIONS])
        out["transformer.ln_f.weight"], out["transformer.ln_f.bias"] = (_c(mc[FINAL_NORM + "weight"]),
                                                                        _c(mc[FINAL_NORM + "bias"]))
    else:
        out["model.embed_tokens.weight"] = _c(mc[EMBED][:V])
        out["model.norm.weight"] = _c(mc[FINAL_NORM + "weight"])
    if m.untie_embeddings:
        out["lm_head.weight"] = _c(mc[OUTPUT][:V])
    return out


def _mixtral_layer_to_hf(out: dict, mc: dict[str, "torch.Tensor"], m: "ModelConfig", i: int, norm2: str) -> None:
    """Layer ``i`` of a Mixtral model into ``out`` (the router and each expert's w1/w3 halves of fc1 and w2)."""
    q, k, v = split_qkv(mc[QKV + "weight"][i], m.num_attention_heads, m.num_query_groups)
    p, ffn = f"model.layers.{i}.", m.moe_ffn_hidden_size
    out[p + "input_layernorm.weight"] = _c(mc[NORM1 + "weight"][i])
    out[p + "post_attention_layernorm.weight"] = _c(mc[norm2 + "weight"][i])
    out[p + "self_attn.q_proj.weight"], out[p + "self_attn.k_proj.weight"] = q, k
    out[p + "self_attn.v_proj.weight"], out[p + "self_attn.o_proj.weight"] = v, _c(mc[PROJ + "weight"][i])
    out[p + "block_sparse_moe.gate.weight"] = _c(mc[ROUTER][i])
    for j in range(m.num_experts):
        e = p + f"block_sparse_moe.experts.{j}."
        fc1 = mc[EXPERT_FC1][i, j]
        out[e + "w1.weight"], out[e + "w3.weight"] = _c(fc1[:ffn]), _c(fc1[ffn:])
        out[e + "w2.weight"] = _c(mc[EXPERT_FC2][i, j])


def _gpt2_layer_to_hf(out: dict, mc: dict[str, "torch.Tensor"], m: "ModelConfig", i: int, norm2: str) -> None:
    """Layer ``i`` of a GPT-2 model into ``out`` (Conv1D weights are [in, out]; biases zero where Megatron has
    none)."""
    import torch

    heads, groups, bias = m.num_attention_heads, m.num_query_groups, m.add_bias_linear
    q, k, v = split_qkv(mc[QKV + "weight"][i], heads, groups)
    qkv_b = split_qkv(mc[QKV + "bias"][i], heads, groups) if bias else None

    def zeros(n: int) -> "torch.Tensor":
        return torch.zeros(n, dtype=mc[EMBED].dtype)

    proj_w, fc1_w, fc2_w = mc[PROJ + "weight"][i], mc[FC1 + "weight"][i], mc[FC2 + "weight"][i]
    p = f"transformer.h.{i}."
    h, ffn = m.hidden_size, m.ffn_hidden_size
    out[p + "ln_1.weight"], out[p + "ln_1.bias"] = _c(mc[NORM1 + "weight"][i]), _c(mc[NORM1 + "bias"][i])
    out[p + "attn.c_attn.weight"] = _c(torch.cat([q, k, v]).t())  # Conv1D: [in, out]
    out[p + "attn.c_attn.bias"] = torch.cat(qkv_b) if bias else zeros(3 * h)
    out[p + "attn.c_proj.weight"] = _c(proj_w.t())
    out[p + "attn.c_proj.bias"] = _c(mc[PROJ + "bias"][i]) if bias else zeros(h)
    out[p + "ln_2.weight"], out[p + "ln_2.bias"] = _c(mc[norm2 + "weight"][i]), _c(mc[norm2 + "bias"][i])
    out[p + "mlp.c_fc.weight"] = _c(fc1_w.t())
    out[p + "mlp.c_fc.bias"] = _c(mc[FC1 + "bias"][i]) if bias else zeros(ffn)
    out[p + "mlp.c_proj.weight"] = _c(fc2_w.t())
    out[p + "mlp.c_proj.bias"] = _c(mc[FC2 + "bias"][i]) if bias else zeros(h)


def _llama_layer_to_hf(out: dict, mc: dict[str, "torch.Tensor"], m: "ModelConfig", i: int, norm2: str) -> None:
    """Layer ``i`` of a Llama-shaped model into ``out`` (fc1 split into gate and up projections)."""
    heads, groups, bias = m.num_attention_heads, m.num_query_groups, m.add_bias_linear
    q, k, v = split_qkv(mc[QKV + "weight"][i], heads, groups)
    qkv_b = split_qkv(mc[QKV + "bias"][i], heads, groups) if bias else None
    proj_w, fc1_w, fc2_w = mc[PROJ + "weight"][i], mc[FC1 + "weight"][i], mc[FC2 + "weight"][i]
    p = f"model.layers.{i}."
    ffn = m.ffn_hidden_size
    out[p + "input_layernorm.weight"] = _c(mc[NORM1 + "weight"][i])
    out[p + "post_attention_layernorm.weight"] = _c(mc[norm2 + "weight"][i])
    out[p + "self_attn.q_proj.weight"], out[p + "self_attn.k_proj.weight"] = q, k
    out[p + "self_attn.v_proj.weight"], out[p + "self_attn.o_proj.weight"] = v, _c(proj_w)
    out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = _c(fc1_w[:ffn]), _c(fc1_w[ffn:])
    out[p + "mlp.down_proj.weight"] = _c(fc2_w)
    if bias:
        for name, t in zip(("q_proj", "k_proj", "v_proj"), qkv_b):
            out[p + f"self_attn.{name}.bias"] = t
        out[p + "self_attn.o_proj.bias"] = _c(mc[PROJ + "bias"][i])
        out[p + "mlp.gate_proj.bias"] = _c(mc[FC1 + "bias"][i][:ffn])
        out[p + "mlp.up_proj.bias"] = _c(mc[FC1 + "bias"][i][ffn:])
        out[p + "mlp.down_proj.bias"] = _c(mc[FC2 + "bias"][i])


def hf_to_megatron(hf: Mapping[str, "torch.Tensor"], m: "ModelConfig", padded_vocab: int,
                   layers: str = LOCAL_LAYERS) -> dict[str, "torch.Tensor"]:
    """Hugging Face state dict -> every global Megatron-core tensor of a model built with ``layers`` (layers stacked,
    vocabulary rows padded with zeros). ``megatron_tensor`` builds one at a time (what an import uses, so that a rank
    holds one layer's tensor at a time, not the model)."""
    import torch

    check_unused_biases(hf, m)
    out = {}
    for key in megatron_keys(m, layers):
        if key.startswith(LAYER):
            out[key] = torch.stack([megatron_tensor(hf, m, key, i, padded_vocab) for i in range(m.num_layers)])
        else:
            out[key] = megatron_tensor(hf, m, key, None, padded_vocab)
    return out


def _get(hf: Mapping[str, "torch.Tensor"], name: str) -> "torch.Tensor":
    if name not in hf:
        raise UserError(f"missing tensor {name}")
    return hf[name]


def check_unused_biases(hf: Mapping[str, "torch.Tensor"], m: "ModelConfig") -> None:
    """A model without linear biases (``model.add_bias_linear: false``) can only take a GPT-2 whose linear biases are
    all zero (a GPT-2 always has them); UserError naming the first nonzero one."""
    if m.add_bias_linear or architecture(m) != GPT2:
        return
    for i in range(m.num_layers):
        for name in ("attn.c_attn.bias", "attn.c_proj.bias", "mlp.c_fc.bias", "mlp.c_proj.bias"):
            full = f"transformer.h.{i}.{name}"
            if full in hf and bool(hf[full].any()):
                raise UserError(f"tensor {full} is nonzero but the recipe has model.add_bias_linear=false (train "
                                "with add_bias_linear: true to keep the biases)")


def megatron_tensor(hf: Mapping[str, "torch.Tensor"], m: "ModelConfig", key: str, layer: int | None,
                    padded_vocab: int) -> "torch.Tensor":
    """One Megatron-core tensor from a Hugging Face state dict: the global tensor of ``key`` (either layer kind's
    name), or for a layer key (``decoder.layers.*``) the row of ``layer``. UserError naming a missing Hugging Face
    tensor."""
    import torch

    if key.startswith(TE_MOE_NORM2):  # the TE MoE layer's own pre-MLP norm: the same tensor
        key = NORM2 + key[len(TE_MOE_NORM2):]
    arch, heads, groups = architecture(m), m.num_attention_heads, m.num_query_groups
    if not key.startswith(LAYER):
        if key == OUTPUT:
            return pad_rows(_get(hf, "lm_head.weight"), padded_vocab)
        llama = {EMBED: "model.embed_tokens.weight", FINAL_NORM + "weight": "model.norm.weight"}
        names = {GPT2: {EMBED: "transformer.wte.weight", POSITIONS: "transformer.wpe.weight",
                        FINAL_NORM + "weight": "transformer.ln_f.weight", FINAL_NORM + "bias": "transformer.ln_f.bias"},
                 LLAMA: llama, MIXTRAL: llama}[arch]
        t = _get(hf, names[key])
        return pad_rows(t, padded_vocab) if key == EMBED else t
    if arch == GPT2:
        p, h = f"transformer.h.{layer}.", m.hidden_size
        if key == QKV + "weight":
            return merge_qkv(*_get(hf, p + "attn.c_attn.weight").t().split(h), heads, groups)
        if key == QKV + "bias":
            return merge_qkv(*_get(hf, p + "attn.c_attn.bias").split(h), heads, groups)
        names = {NORM1 + "weight": "ln_1.weight", NORM1 + "bias": "ln_1.bias", NORM2 + "weight": "ln_2.weight",
                 NORM2 + "bias": "ln_2.bias", PROJ + "bias": "attn.c_proj.bias", FC1 + "bias": "mlp.c_fc.bias",
                 FC2 + "bias": "mlp.c_proj.bias"}
        transposed = {PROJ + "weight": "attn.c_proj.weight", FC1 + "weight": "mlp.c_fc.weight",
                      FC2 + "weight": "mlp.c_proj.weight"}  # Conv1D: [in, out]
        if key in transposed:
            return _get(hf, p + transposed[key]).t()
        return _get(hf, p + names[key])
    p = f"model.layers.{layer}."
    if key in EXPERT_KEYS:  # Mixtral: the layer's router, or its experts stacked [experts, ...]
        moe = p + "block_sparse_moe."
        if key == ROUTER:
            return _get(hf, moe + "gate.weight")
        if key == EXPERT_FC1:
            return torch.stack([torch.cat([_get(hf, moe + f"experts.{j}.w1.weight"),
                                           _get(hf, moe + f"experts.{j}.w3.weight")]) for j in range(m.num_experts)])
        return torch.stack([_get(hf, moe + f"experts.{j}.w2.weight") for j in range(m.num_experts)])
    kind = key.rsplit(".", 1)[1]  # weight / bias
    if key in (QKV + "weight", QKV + "bias"):  # (the norm keys share the prefix)
        return merge_qkv(*(_get(hf, p + f"self_attn.{n}_proj.{kind}") for n in "qkv"), heads, groups)
    if key in (FC1 + "weight", FC1 + "bias"):
        return torch.cat([_get(hf, p + f"mlp.gate_proj.{kind}"), _get(hf, p + f"mlp.up_proj.{kind}")])
    names = {NORM1 + "weight": "input_layernorm.weight", NORM2 + "weight": "post_attention_layernorm.weight",
             PROJ + "weight": "self_attn.o_proj.weight", PROJ + "bias": "self_attn.o_proj.bias",
             FC2 + "weight": "mlp.down_proj.weight", FC2 + "bias": "mlp.down_proj.bias"}
    return _get(hf, p + names[key])


def pad_rows(t: "torch.Tensor", rows: int) -> "torch.Tensor":
    """``t`` with zero rows appended up to ``rows`` (Megatron's padded vocabulary)."""
    import torch

    if t.shape[0] > rows:
        raise UserError(f"an embedding of {t.shape[0]} rows does not fit the padded vocabulary of {rows}")
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if t.shape[0] < rows else t
