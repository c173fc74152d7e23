"""The Hugging Face causal LM every backend that trains one builds on (FSDP and Horovod wrap its job; DeepSpeed
uses its model, values and loss): a base below the backend packages, importing none of them.

Modules: ``model`` (the empty model from the recipe, its blocks, AdamW's groups), ``values`` (the seeded initial
value of each parameter or ``checkpoint.init_from_hf``'s, filled into an empty model; loading a state dict),
``loss`` (the next-token loss, Liger Kernel's fused layers), ``checkpoint`` (torch Distributed Checkpoint save, async
save and resume), ``export`` (a checkpoint -> a Hugging Face folder), ``job`` (``CausalLMJob``: data, step,
evaluation, checkpoints and resume on the shared loop; a backend's job overrides its hooks). The names most callers
use are importable from here; torch is imported only when called.
"""

from hpc_tools.train.hf_causal_lm.loss import apply_liger, causal_lm_loss, forward_loss, liger_requested
from hpc_tools.train.hf_causal_lm.values import initial_value, initial_values, load_into

__all__ = ["apply_liger", "causal_lm_loss", "forward_loss", "initial_value", "initial_values", "liger_requested",
           "load_into"]
