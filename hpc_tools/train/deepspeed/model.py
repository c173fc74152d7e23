"""The Hugging Face causal LM of a DeepSpeed job: built from ``model:`` or loaded from a local folder.

``model.family: gpt`` -> GPT2Config / GPT2LMHeadModel (LayerNorm, GELU, learned positions, biases);
``model.family: llama`` -> LlamaConfig / LlamaForCausalLM (RMSNorm, SwiGLU, RoPE, GQA with num_query_groups).
A recipe asking for a mix the Hugging Face class cannot express is refused with the field to change.
Under ZeRO-3 the model is built under ``HfDeepSpeedConfig`` so that from_config/from_pretrained partition the
parameters as they are created (zero.Init) and still run Hugging Face's weight initialisation.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from hpc_tools.errors import UserError
from hpc_tools.hf.config import ATTENTION, check_expressible, hf_config
from hpc_tools.train.hf_causal_lm.values import initial_values

if TYPE_CHECKING:
    from hpc_tools.recipe.schema import Recipe


def pretrained_config(path: str):
    """The config of a local Hugging Face model folder (``backend.deepspeed.pretrained_path``)."""
    from transformers import AutoConfig

    if not os.path.isdir(path):
        raise UserError(f"backend.deepspeed.pretrained_path={path} is not a local folder (give a folder written by "
                        "save_pretrained; nothing is downloaded)")
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # transformers raises several types for a bad folder
        raise UserError(f"backend.deepspeed.pretrained_path={path} holds no readable config.json "
                        f"({type(exc).__name__}) (give a folder written by save_pretrained)") from None


def build_model(recipe: "Recipe", ds_config: dict[str, Any]):
    """(model, keepalive): the causal LM, seeded; keep ``keepalive`` referenced while the engine lives (ZeRO-3)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from hpc_tools.train.imports import import_transformers

    import_transformers()  # without what no rank uses (torchao, scipy: ~600 modules)
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    path = recipe.backend.deepspeed.pretrained_path
    cfg = pretrained_config(path) if path else hf_config(recipe)
    if path:
        check_expressible_options(recipe)
    # Import the concrete class before zero.Init: importing it for the first time inside zero.Init fails.
    _model_class(cfg)
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()  # an earlier ZeRO-3 job in this process must not turn this build into zero.Init
    keepalive = None
    if recipe.backend.deepspeed.zero_stage == 3:
        from transformers.integrations import HfDeepSpeedConfig

        keepalive = HfDeepSpeedConfig(ds_config)  # transformers holds it weakly: the caller keeps it alive
    torch.manual_seed(recipe.training.seed)  # identical initial weights on every rank
    if path:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, attn_implementation=ATTENTION,
                                                     dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=ATTENTION, dtype=torch.float32)
        initialize_weights(model, recipe)
    if recipe.training.recompute_granularity == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model, keepalive


def check_expressible_options(recipe: "Recipe") -> None:
    """With a pretrained folder only the training options matter (the rule skips the architecture checks then)."""
    check_expressible(recipe)


def _model_class(cfg):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM._model_mapping[type(cfg)]


def initialize_weights(model, recipe: "Recipe") -> None:
    """Overwrite every parameter with its ``hf_causal_lm.values.initial_value``: under ZeRO-3 zero.Init consumes the
    random stream in another order than a plain build, so HF's own initialisation would give each stage different
    starting weights."""
    import torch

    value_of = initial_values(model, recipe)
    with torch.no_grad():
        for name, param in model.named_parameters():
            shape = tuple(param.ds_shape) if hasattr(param, "ds_shape") else tuple(param.shape)
            value = value_of(name, shape)
            if hasattr(param, "ds_id"):  # ZeRO-3 partitioned: gather, let rank 0 write, re-partition
                import deepspeed

                with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                    param.data.copy_(value)
            else:
                param.data.copy_(value)
