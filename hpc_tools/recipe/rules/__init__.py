"""Cross-field rules a recipe must satisfy before anything is written or queued.

Each rule is a small function registered with ``@rule`` (``registry``); ``check_recipe`` runs them all and returns
every violation, so ``validate`` reports all problems at once. The rules live by subject, registered in this order
(the order violations are reported in and ``validate --rules`` lists them): the parallel layout (``layout``),
experts, context parallelism, FP8 and multi-latent attention (``experts``), the backend kinds (``backends``),
training, data, checkpoints and settings that take no effect (``training``, which registers ``recipe.noops``' rules),
and the cluster and launch (``cluster``). The layout arithmetic itself lives in ``hpc_tools.layout``.
"""

from __future__ import annotations

from hpc_tools.recipe.rules.registry import (
    DERIVED,
    NOTES,
    RULES,
    Rule,
    RuleFn,
    check_recipe,
    divisors,
    merged,
    note,
    recipe_notes,
    rule,
)

# The sections are imported in this order, which is the order their rules register in (and violations are reported
# in): an import sorter must not reorder them.
# isort: off
from hpc_tools.recipe.rules import layout  # noqa: F401
from hpc_tools.recipe.rules import experts  # noqa: F401
from hpc_tools.recipe.rules import backends  # noqa: F401
from hpc_tools.recipe.rules import training  # noqa: F401
from hpc_tools.recipe.rules import cluster  # noqa: F401
# isort: on
from hpc_tools.recipe.rules.backends import HF_FAMILY_SHAPE, backend_features, deepspeed_model_expressible
from hpc_tools.recipe.rules.experts import FP8_MULTIPLE, gpu_has_fp8, gpu_has_mxfp8, megatron_attentions
from hpc_tools.recipe.rules.training import LOCAL_DIR_EXAMPLE

__all__ = ["DERIVED", "FP8_MULTIPLE", "HF_FAMILY_SHAPE", "LOCAL_DIR_EXAMPLE", "NOTES", "RULES", "Rule",
           "RuleFn", "backend_features", "check_recipe", "deepspeed_model_expressible", "divisors", "gpu_has_fp8",
           "gpu_has_mxfp8", "megatron_attentions", "merged", "note", "recipe_notes", "rule"]
