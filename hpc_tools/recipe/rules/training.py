"""Rules of training, data and checkpoints, and of settings that take no effect (with ``noops``' rules, registered
here after ``settings_take_effect``)."""

from __future__ import annotations

import re
from typing import Iterator

from hpc_tools.errors import Violation
from hpc_tools.layout import ParallelLayout
from hpc_tools.recipe.rules.registry import rule
from hpc_tools.recipe.schema import Recipe

# --- training, data, cluster ------------------------------------------------------------------------------------------

@rule
def lr_schedule(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """min_lr <= lr and warm-up no longer than the decay."""
    t = r.training
    if t.min_lr > t.lr:
        yield Violation("training.min_lr", t.min_lr, f"exceeds training.lr={t.lr}", f"use a value <= {t.lr}")
    decay = t.lr_decay_iters or t.train_iters
    if t.lr_warmup_iters > decay:
        yield Violation("training.lr_warmup_iters", t.lr_warmup_iters, f"exceeds the decay length {decay}",
                        f"use at most {decay}")


@rule
def data_sources(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """source: files needs paths, source: indexed a blend; the byte tokenizer needs vocab_size >= 257."""
    if r.data.source == "files" and not r.data.paths:
        yield Violation("data.paths", [], "is empty but data.source=files",
                        "list local files or folders, or use source: synthetic")
    if r.data.source == "indexed" and not r.data.blend:
        yield Violation("data.blend", [], "is empty but data.source=indexed",
                        "list prepared datasets as {path: PREFIX, weight: W} (python -m hpc_tools data prepare)")
    if r.data.tokenizer == "byte" and r.model.vocab_size < 257:
        yield Violation("model.vocab_size", r.model.vocab_size, "is below the byte tokenizer's 257 tokens",
                        "use vocab_size >= 257")


@rule
def checkpoint_local_tier(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """The node-local checkpoint tier has both its folder and its interval, an absolute folder (a relative one would
    be under the folder the job starts in, on the shared file system) and an interval that some save falls on
    (below train_iters, not a multiple of the shared tier's interval, whose saves take the steps due on both)."""
    ck, iters = r.checkpoint, r.training.train_iters
    if ck.local_interval_iters and not ck.local_dir:
        yield Violation("checkpoint.local_interval_iters", ck.local_interval_iters, "needs checkpoint.local_dir",
                        f"set checkpoint.local_dir (e.g. {LOCAL_DIR_EXAMPLE}) or local_interval_iters: 0")
    if ck.local_dir and not ck.local_interval_iters:
        yield Violation("checkpoint.local_dir", ck.local_dir, "is never written: checkpoint.local_interval_iters is 0",
                        "set checkpoint.local_interval_iters (e.g. 10) or remove local_dir")
    if ck.local_dir and not ck.local_dir.startswith(("/", "~", "$")):
        yield Violation("checkpoint.local_dir", ck.local_dir, "is a relative path: it would be under the folder the "
                        "job starts in, on the shared file system, not on a node-local disk",
                        f"give an absolute node-local path, e.g. {LOCAL_DIR_EXAMPLE}")
    if ck.local_dir and ck.local_interval_iters >= iters:
        yield Violation("checkpoint.local_interval_iters", ck.local_interval_iters, f"is never reached: "
                        f"training.train_iters={iters} ends first (the last save goes to checkpoint.dir)",
                        f"use fewer than {iters} steps, or local_interval_iters: 0")
    elif ck.local_dir and ck.local_interval_iters and ck.interval_iters and \
            ck.local_interval_iters % ck.interval_iters == 0:
        yield Violation("checkpoint.local_interval_iters", ck.local_interval_iters, "falls only on steps that "
                        f"checkpoint.interval_iters={ck.interval_iters} saves to checkpoint.dir (a step due on both "
                        "tiers saves there): the local tier is never written",
                        f"use a value below {ck.interval_iters}" if ck.interval_iters > 1 else
                        "raise checkpoint.interval_iters, or remove the local tier")
    if ck.local_replicate_interface is not None and not _IFNAMES.fullmatch(ck.local_replicate_interface):
        yield Violation("checkpoint.local_replicate_interface", ck.local_replicate_interface, "is not a network "
                        "interface name (Linux names: 1-15 letters, digits or ._:-, several comma-separated as "
                        "GLOO_SOCKET_IFNAME takes them)", "give the name `ip -br addr` shows, e.g. ib0, or remove it")


_IFNAMES = re.compile(r"[A-Za-z0-9_.:-]{1,15}(,[A-Za-z0-9_.:-]{1,15})*")
"""GLOO_SOCKET_IFNAME's form: Linux interface names (at most IFNAMSIZ - 1 = 15 bytes), comma-separated."""


# A node-local folder named by a variable Slurm itself sets in every job ($SLURM_TMPDIR is a site convention).
LOCAL_DIR_EXAMPLE = "/tmp/$SLURM_JOB_ID/ckpt"


def _written(section, name: str) -> bool:
    """Whether the recipe (file, site file, profile or --set) wrote the field, rather than leaving its default."""
    return name in section.model_fields_set


@rule
def settings_take_effect(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """A value written for a feature the recipe does not turn on does nothing, and is refused: fp8_recipe without
    fp8, the router's moe_* options without num_experts, a moe_layer_freq list with no MoE layer, recompute_method
    or recompute_num_layers without full recomputation, local_replicate without a local tier. A feature turned off
    on purpose (fp8: null, num_experts: null, recompute_granularity, local_dir: null written, as a profile does)
    leaves its options alone."""
    t, m, ck = r.training, r.model, r.checkpoint
    if t.fp8 is None and _written(t, "fp8_recipe") and not _written(t, "fp8"):
        yield Violation("training.fp8_recipe", t.fp8_recipe, "is read only with training.fp8 (null: no FP8; "
                        "fp8_recipe does not turn it on)", "set training.fp8: e4m3 or hybrid, or remove fp8_recipe")
    if t.recompute_granularity != "full" and not _written(t, "recompute_granularity"):
        for name in ("recompute_method", "recompute_num_layers"):
            if _written(t, name):
                yield Violation(f"training.{name}", getattr(t, name), "is read only with "
                                "training.recompute_granularity=full (it does not turn recomputation on)",
                                f"set recompute_granularity: full, or remove {name}")
                break
    if ck.local_dir is None and _written(ck, "local_replicate") and not _written(ck, "local_dir"):
        yield Violation("checkpoint.local_replicate", ck.local_replicate, "is read only with checkpoint.local_dir "
                        "(the node-local tier it copies)", f"set checkpoint.local_dir (e.g. {LOCAL_DIR_EXAMPLE}) and "
                        "local_interval_iters, or remove local_replicate")
    if m.num_experts is None and not _written(m, "num_experts"):
        router = [f for f in ("moe_router_topk", "moe_router_load_balancing_type", "moe_aux_loss_coeff",
                              "moe_router_score_function", "moe_router_enable_expert_bias",
                              "moe_token_dispatcher_type", "moe_expert_capacity_factor", "moe_grouped_gemm",
                              "moe_layer_freq") if _written(m, f)]
        if router:
            yield Violation(f"model.{router[0]}", getattr(m, router[0]), "is read only with model.num_experts (a "
                            "dense model has no experts)", f"set model.num_experts, or remove {router[0]}")
    if m.num_experts is not None and isinstance(m.moe_layer_freq, list) and m.moe_layer_freq and \
            not any(m.moe_layer_freq):
        yield Violation("model.moe_layer_freq", m.moe_layer_freq, f"has no 1: no layer is MoE, and the "
                        f"model.num_experts={m.num_experts} experts are never built (a dense model)",
                        "put a 1 at each MoE layer, or set num_experts: null")


# The no-op rules that need to know which layer wrote a value (another kind's options, fp8_recipe beside fp8: null),
# registered here, after settings_take_effect (noops imports nothing of this module: no import cycle)
from hpc_tools.recipe.noops import fp8_recipe_without_fp8, other_backend_options  # noqa: E402

rule(fp8_recipe_without_fp8)
rule(other_backend_options)
