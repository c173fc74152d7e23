"""The Hugging Face mapping's Megatron keys against the layer specs the project builds, for both layer kinds.

A GPU run builds Transformer Engine layers, which CPU runs never build, so the checkpoint keys of a TE model are
derived here from the spec itself: the project's own ``model.block_spec`` (megatron-core's TE spec functions, called
on CPU with TE's spec provider, whose TE classes are megatron-core's stand-ins when TE is not installed) is walked
module by module, each leaf class giving the parameters it registers (``LEAF_PARAMS``: TE's and megatron-core's
names), and the layer's ``sharded_state_dict_keys_map`` applied with megatron-core's own ``apply_prefix_mapping``, as
``TransformerLayer.sharded_state_dict`` applies it. The mapping's ``megatron_keys`` for the recorded layer kind must
be exactly that set: a TE MoE layer keeps its own ``pre_mlp_layernorm`` (``TENorm``), which the local spec renames
to ``mlp.linear_fc1.layer_norm_``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import pytest

from hpc_tools.errors import UserError
from hpc_tools.layout import ParallelLayout
from hpc_tools.recipe.load import resolve

pytestmark = pytest.mark.megatron

MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64, "vocab_size": 512}
BASE = {
    "name": "layer_keys",
    "model": MODEL,
    "training": {"micro_batch_size": 1, "global_batch_size": 8, "train_iters": 2, "precision": "bf16"},
    "backend": {"kind": "megatron"},
    "data": {"source": "synthetic"},
    "cluster": {"nodes": 1, "gpus_per_node": 8, "gpu_type": "H100-SXM"},
}
LLAMA = ["model.family=llama", "model.num_query_groups=2"]
MIXTRAL = [*LLAMA, "model.num_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=96"]
GPT2 = ["model.family=gpt", "model.add_bias_linear=true"]
MODELS = {"mixtral": MIXTRAL, "mixtral sequential experts": [*MIXTRAL, "model.moe_grouped_gemm=false"],
          "llama": LLAMA, "llama untied": [*LLAMA, "model.untie_embeddings=true"], "gpt2": GPT2}


def _norm(normalization: str) -> list[str]:
    return ["weight", "bias"] if normalization == "LayerNorm" else ["weight"]


def _linear(bias: bool) -> list[str]:
    return ["weight", "bias"] if bias else ["weight"]


LEAF_PARAMS = {
    # Transformer Engine modules (TE 2.11: te.pytorch.LayerNorm/RMSNorm, Linear, LayerNormLinear; a linear without
    # bias registers none) as megatron-core's extensions/transformer_engine.py wraps them
    "TENorm": lambda n, b: _norm(n),
    "TELayerNormColumnParallelLinear": lambda n, b: ["layer_norm_" + x for x in _norm(n)] + _linear(b),
    "TEColumnParallelLinear": lambda n, b: _linear(b),
    "TERowParallelLinear": lambda n, b: _linear(b),
    "TELinear": lambda n, b: _linear(b),
    "TEDotProductAttention": lambda n, b: [],
    # megatron-core's local modules and the project's norm (a torch LayerNorm / RMSNorm)
    "SequenceParallelNorm": lambda n, b: _norm(n),
    "WrappedTorchNorm": lambda n, b: _norm(n),
    "FusedLayerNorm": lambda n, b: _norm(n),
    "ColumnParallelLinear": lambda n, b: _linear(b),
    "RowParallelLinear": lambda n, b: _linear(b),
    "DotProductAttention": lambda n, b: [],
    "IdentityOp": lambda n, b: [],
    "IdentityFuncOp": lambda n, b: [],
}
STANDINS: dict[int, str] = {}
"""Without TE, megatron-core's TE classes that subclass a TE module are MagicMock stand-ins (its extension module
imports a MagicMock for TE): their names by identity (``te_specs``)."""
EXPERTS = {"TEGroupedMLP", "SequentialMLP"}
"""Expert modules whose sharded keys are ``experts.linear_fc1.weight`` / ``experts.linear_fc2.weight`` stacked over
the experts (TEGroupedMLP's are "interchangeable with SequentialMLP's", megatron-core's experts.py)."""


def _name(module) -> str | None:
    """A spec entry's class name (a TE stand-in's by identity); None for a function (bias-dropout-add)."""
    if isinstance(module, type):
        return module.__name__
    if id(module) in STANDINS:
        return STANDINS[id(module)]
    if inspect.isfunction(module) or isinstance(module, functools.partial):
        return None
    raise AssertionError(f"unknown spec entry {module!r}")


def _module_keys(spec, prefix: str, m) -> list[str]:
    """The state-dict keys of the module a spec entry builds (a class or a ModuleSpec) for model section ``m``,
    below ``prefix``."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    module = spec.module if isinstance(spec, ModuleSpec) else spec
    submodules = spec.submodules if isinstance(spec, ModuleSpec) else None
    name = _name(module)
    if name is None:
        return []
    if name == "MoELayer":  # the router (built by the layer itself) and the experts' stacked keys
        assert _name(submodules.experts.module) in EXPERTS, submodules.experts
        assert m.moe_shared_expert_intermediate_size is None  # (the layer builds shared experts only with a size)
        return [prefix + "router.weight", prefix + "experts.experts.linear_fc1.weight",
                prefix + "experts.experts.linear_fc2.weight"]
    if name in LEAF_PARAMS:
        return [prefix + p for p in LEAF_PARAMS[name](m.normalization, bool(m.add_bias_linear))]
    assert submodules is not None and dataclasses.is_dataclass(submodules), f"no parameter names for {name}"
    keys = []
    for f in dataclasses.fields(submodules):
        value = getattr(submodules, f.name)
        if value is None or isinstance(value, dict):  # absent, or the keys map
            continue
        keys += _module_keys(value, f"{prefix}{f.name}.", m)
    return keys


def spec_keys(block, m) -> set[str]:
    """Checkpoint keys of a GPTModel whose decoder is ``block`` (a TransformerBlockSubmodules, or one layer's
    ModuleSpec as GPTModel takes it), each layer's keys map applied as megatron-core applies it."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.utils import apply_prefix_mapping
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    if isinstance(block, TransformerBlockSubmodules):
        layers, final = block.layer_specs, block.layer_norm
    else:  # one TransformerLayer spec: TransformerBlock repeats it and adds its default final norm
        layers, final = [block], None
    keys = set()
    for layer in layers:
        objs = {k: ShardedObject(k, None, (1,), (0,), replica_id=0)
                for k in _module_keys(layer, "decoder.layers.", m)}
        apply_prefix_mapping(objs, {f"decoder.layers.{a}": f"decoder.layers.{b}"
                                    for a, b in layer.submodules.sharded_state_dict_keys_map.items()})
        keys |= {o.key for o in objs.values()}
    if final is None:  # TransformerBlock's own final norm (LayerNormImpl: apex's FusedLayerNorm or WrappedTorchNorm)
        keys |= {"decoder.final_layernorm." + p for p in _norm(m.normalization)}
    else:
        keys |= set(_module_keys(final, "decoder.final_layernorm.", m))
    keys.add("embedding.word_embeddings.weight")  # GPTModel's own (not in the block spec)
    if m.position_embedding == "learned_absolute":
        keys.add("embedding.position_embeddings.weight")
    if m.untie_embeddings:
        keys.add("output_layer.weight")
    return keys


@pytest.fixture
def te_specs(monkeypatch):
    """megatron-core's TE spec functions callable on CPU: gpt_layer_specs binds TESpecProvider and TENorm only when
    ``import transformer_engine`` works; the spec provider asks TE's version (2.11: newer than all it asks). One
    pipeline stage."""
    from megatron.core.extensions import transformer_engine as te_extension
    from megatron.core.extensions import transformer_engine_spec_provider as provider
    from megatron.core.models.gpt import gpt_layer_specs

    monkeypatch.setattr(gpt_layer_specs, "TESpecProvider", provider.TESpecProvider, raising=False)
    monkeypatch.setattr(gpt_layer_specs, "TENorm", te_extension.TENorm, raising=False)
    monkeypatch.setattr(gpt_layer_specs, "TEFusedMLP", te_extension.TEFusedMLP, raising=False)
    # TE >= 1.9 has grouped linears (megatron-core then picks TEGroupedMLP); the stand-in module leaves them None
    for name in ("TEColumnParallelGroupedLinear", "TERowParallelGroupedLinear"):
        if getattr(provider, name) is None:
            monkeypatch.setattr(provider, name, type(name, (), {}))
    from unittest.mock import NonCallableMock

    for name, value in vars(te_extension).items():
        if isinstance(value, NonCallableMock):
            monkeypatch.setitem(STANDINS, id(value), name)
    monkeypatch.setattr(provider, "is_te_min_version", lambda version, check_equality=True: True)
    # one pipeline stage: the block spec asks the (here absent) pipeline group for this rank's stage
    from megatron.core import parallel_state

    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda *a, **k: 0)
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda *a, **k: 1)


def built_spec(monkeypatch, sets: list[str], layers: str):
    """The recipe and the decoder spec ``model.block_spec`` builds for it on a GPU with ``layers``."""
    from hpc_tools.train.megatron import config as config_module
    from hpc_tools.train.megatron import model as model_module
    from hpc_tools.train.megatron.config import transformer_config
    from hpc_tools.train.megatron.layers import layer_plan

    # the fused kernels are TE's and CUDA's (TransformerConfig checks they import) and no part of the spec: off
    real = config_module.fusions
    monkeypatch.setattr(config_module, "fusions", lambda recipe, device_type, plan: real(recipe, "cpu", plan))

    te = layers == "transformer_engine"
    extra = [] if te else ["backend.megatron.transformer_impl=local", "backend.megatron.use_flash_attention=false"]
    r = resolve(BASE, [*sets, *extra], source="test")
    plan = layer_plan(r, "cuda", te_available=te)
    assert plan.layers == layers
    monkeypatch.setattr(model_module, "layer_plan", lambda recipe, device_type: plan)
    config = transformer_config(r, ParallelLayout.from_recipe(r), "cuda", plan)
    return r, model_module.block_spec(r, config, "cuda", None)


@pytest.mark.parametrize("layers", ["transformer_engine", "local"])
@pytest.mark.parametrize("name", list(MODELS))
def test_mapping_keys_are_the_built_specs_keys(te_specs, monkeypatch, name, layers):
    from hpc_tools.hf.mapping import architecture, megatron_keys

    r, block = built_spec(monkeypatch, MODELS[name], layers)
    architecture(r.model)  # expressible in Hugging Face
    want = spec_keys(block, r.model)
    got = megatron_keys(r.model, layers)
    assert len(got) == len(set(got))
    assert set(got) == want, (sorted(set(got) - want), sorted(want - set(got)))


def test_the_te_moe_layer_keeps_its_own_pre_mlp_norm(te_specs, monkeypatch):
    """The difference the mapping follows, as the specs show it."""
    r, te_block = built_spec(monkeypatch, MIXTRAL, "transformer_engine")
    te = spec_keys(te_block, r.model)
    local = spec_keys(built_spec(monkeypatch, MIXTRAL, "local")[1], r.model)
    assert te - local == {"decoder.layers.pre_mlp_layernorm.weight"}
    assert local - te == {"decoder.layers.mlp.linear_fc1.layer_norm_weight"}


@pytest.mark.parametrize("sets", [[*LLAMA, "model.multi_latent_attention=true", "model.num_query_groups=4"],
                                  [*MIXTRAL, "model.multi_latent_attention=true", "model.num_query_groups=4"]])
def test_multi_latent_attention_is_refused_in_one_line(te_specs, monkeypatch, sets):
    """MLA layers (either kind) have keys no Hugging Face class holds: refused by name, before any key is read."""
    from hpc_tools.hf.mapping import architecture

    r, block = built_spec(monkeypatch, sets, "transformer_engine")
    assert any("linear_kv_down_proj" in k for k in spec_keys(block, r.model))
    with pytest.raises(UserError, match=r"^model\.multi_latent_attention=(true|True) .*\(.*\)$"):
        architecture(r.model)


def test_te_moe_round_trip_through_hugging_face():
    """hf -> Megatron (TE MoE keys) -> hf is exact, and a TE key is filled from post_attention_layernorm."""
    import torch

    from hpc_tools.hf import mapping

    m = resolve(BASE, MIXTRAL, source="test").model
    padded = m.padded_vocab_size(1)
    hf = mapping.megatron_to_hf(_shaped(m, padded), m)
    te = mapping.hf_to_megatron(hf, m, padded, "transformer_engine")
    assert set(te) == set(mapping.megatron_keys(m, "transformer_engine"))
    assert torch.equal(te[mapping.TE_MOE_NORM2 + "weight"][1], hf["model.layers.1.post_attention_layernorm.weight"])
    back = mapping.megatron_to_hf(te, m, "transformer_engine")
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)
    with pytest.raises(KeyError, match="missing Megatron tensors"):
        mapping.megatron_to_hf(te, m)  # read as local layers: the norm is not where local layers keep it


def _shaped(m, padded: int) -> dict:
    """Random global Megatron tensors of the local layout, of the model's shapes."""
    import torch

    from hpc_tools.hf import mapping

    L, h, E, f = m.num_layers, m.hidden_size, m.num_experts, m.moe_ffn_hidden_size
    qkv = (m.num_query_groups * (m.num_attention_heads // m.num_query_groups + 2)) * m.head_dim
    shapes = {mapping.EMBED: (padded, h), mapping.NORM1 + "weight": (L, h), mapping.NORM2 + "weight": (L, h),
              mapping.FINAL_NORM + "weight": (h,), mapping.QKV + "weight": (L, qkv, h),
              mapping.PROJ + "weight": (L, h, m.num_attention_heads * m.head_dim),
              mapping.ROUTER: (L, E, h), mapping.EXPERT_FC1: (L, E, 2 * f, h), mapping.EXPERT_FC2: (L, E, h, f)}
    if m.untie_embeddings:
        shapes[mapping.OUTPUT] = (padded, h)
    assert set(shapes) == set(mapping.megatron_keys(m))
    return {k: torch.randn(*s) for k, s in shapes.items()}


@pytest.mark.parametrize("recorded", [True, False])
def test_export_reads_a_te_moe_checkpoint_by_its_layer_kind(tmp_path, recorded):
    """A torch_dist checkpoint of a TE MoE model (its keys): the export takes the kind from the meta's record (or,
    for a checkpoint from before the record, from its keys), reads every tensor and maps it; read as local layers,
    it lacks the tensors (the failure of every GPU MoE export before)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from hpc_tools.hf import mapping
    from hpc_tools.train.megatron.hf_export import layer_kind, read_megatron

    m = resolve(BASE, MIXTRAL, source="test").model
    padded = m.padded_vocab_size(1)
    hf = mapping.megatron_to_hf(_shaped(m, padded), m)
    te = mapping.hf_to_megatron(hf, m, padded, "transformer_engine")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(te, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    meta = {"layout": {"layers": "transformer_engine"}} if recorded else {"layout": {}}
    assert layer_kind(meta, tmp_path) == "transformer_engine"
    assert layer_kind({"layout": {"layers": "local"}}, tmp_path) == "local"  # the record wins
    got = read_megatron(tmp_path, mapping.megatron_keys(m, layer_kind(meta, tmp_path)))
    back = mapping.megatron_to_hf(got, m, "transformer_engine")
    assert all(torch.equal(back[k], hf[k]) for k in hf)
    with pytest.raises(UserError, match=r"lacks the tensors \['decoder\.layers\.mlp\.linear_fc1\.layer_norm_weight'\]"):
        read_megatron(tmp_path, mapping.megatron_keys(m, "local"))
