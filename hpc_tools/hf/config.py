"""The one recipe -> transformers config: what a recipe's model section is as a Hugging Face GPT-2 / LLaMA config.

Used by the backends that build Hugging Face classes (DeepSpeed) and by ``export`` for every backend's folder. A model
section the family's class cannot express is refused with the recipe's own rules (``check_expressible``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hpc_tools.data.tokenizer import BYTE_EOS_ID

if TYPE_CHECKING:
    from hpc_tools.recipe.schema import Recipe


ATTENTION = "sdpa"
"""Causal masking comes from sdpa's is_causal when no mask is given (the pipeline stages rely on it)."""


def check_expressible(recipe: "Recipe") -> None:
    """Refuse model options the family's Hugging Face class cannot represent (the rule lives in recipe.rules, so
    `validate` reports it before anything is queued; this re-check guards recipes built in code)."""
    from hpc_tools.errors import RecipeError
    from hpc_tools.layout import ParallelLayout
    from hpc_tools.recipe.rules import backend_features, deepspeed_model_expressible

    layout = ParallelLayout.from_recipe(recipe)
    violations = [v for rule in (backend_features, deepspeed_model_expressible) for v in rule(recipe, layout)]
    if violations:
        raise RecipeError(violations)


def hf_config(recipe: "Recipe"):
    """The transformers config for ``model:`` (fp32 weights; DeepSpeed casts for bf16/fp16); a mixture of experts is
    a Mixtral config (``hpc_tools.hf.mapping.architecture`` says what it must be: Megatron-trained only)."""
    m = recipe.model
    if m.num_experts is not None:
        return _mixtral_config(recipe)
    check_expressible(recipe)
    eos = BYTE_EOS_ID if recipe.data.tokenizer == "byte" else None
    common: dict[str, Any] = {"vocab_size": m.vocab_size, "tie_word_embeddings": not m.untie_embeddings,
                              "initializer_range": m.init_method_std, "bos_token_id": eos, "eos_token_id": eos,
                              "use_cache": False}
    if m.family == "gpt":
        from transformers import GPT2Config

        cfg = GPT2Config(n_positions=m.seq_length, n_embd=m.hidden_size, n_layer=m.num_layers,
                         n_head=m.num_attention_heads, n_inner=m.ffn_hidden_size, activation_function="gelu",
                         resid_pdrop=m.hidden_dropout, embd_pdrop=m.hidden_dropout, attn_pdrop=m.attention_dropout,
                         layer_norm_epsilon=m.norm_epsilon, **common)
    else:
        from transformers import LlamaConfig

        cfg = LlamaConfig(hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
                          num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
                          num_key_value_heads=m.num_query_groups, hidden_act="silu",
                          max_position_embeddings=m.seq_length, rms_norm_eps=m.norm_epsilon,
                          rope_parameters={"rope_type": "default", "rope_theta": float(m.rotary_base)},
                          attention_bias=m.add_bias_linear, mlp_bias=m.add_bias_linear,
                          attention_dropout=m.attention_dropout, **common)
    cfg._attn_implementation = ATTENTION
    return cfg


def _mixtral_config(recipe: "Recipe"):
    from transformers import MixtralConfig

    from hpc_tools.hf.mapping import architecture

    architecture(recipe.model)  # a UserError naming the field Mixtral cannot express
    m = recipe.model
    eos = BYTE_EOS_ID if recipe.data.tokenizer == "byte" else None
    cfg = MixtralConfig(vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.moe_ffn_hidden_size,
                        num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
                        num_key_value_heads=m.num_query_groups, head_dim=m.head_dim, hidden_act="silu",
                        max_position_embeddings=m.seq_length, rms_norm_eps=m.norm_epsilon,
                        rope_parameters={"rope_type": "default", "rope_theta": float(m.rotary_base)},
                        num_local_experts=m.num_experts, num_experts_per_tok=m.moe_router_topk,
                        router_aux_loss_coef=m.moe_aux_loss_coeff, attention_dropout=m.attention_dropout,
                        tie_word_embeddings=not m.untie_embeddings, initializer_range=m.init_method_std,
                        bos_token_id=eos, eos_token_id=eos, use_cache=False)
    cfg._attn_implementation = ATTENTION
    return cfg
