"""The GPU path's decisions, checked on CPU (issue 12): the CUDA TransformerConfig (fusions, p2p, attention backend),
the layer plan and its fail-fast, the device choice and CUDA fail-fast, DeepSpeed's GPU config, per-stage seeds."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from hpc_tools.errors import UserError
from hpc_tools.layout import ParallelLayout
from hpc_tools.recipe.load import load_recipe, resolve

REPO_RECIPE = "recipes/gpt_3d.yaml"


def gpt3d(*sets: str):
    return load_recipe(REPO_RECIPE, overrides=list(sets))


def plan_of(recipe, device="cuda", te=True):
    from hpc_tools.train.megatron.layers import layer_plan

    return layer_plan(recipe, device, te_available=te)


# -- layer plan (item 5; issue 25 items 1 and 7) -----------------------------------------------------------------------

def test_plan_on_gpu_names_te_and_lets_te_choose_the_attention():
    r = gpt3d()
    assert r.training.precision == "bf16"
    plan = plan_of(r)
    assert plan.attention == "auto" and plan.flash_style
    assert plan.describe() == "layers=transformer_engine, attention=te-flash|te-fused"  # TE chooses at the 1st forward
    off = plan_of(gpt3d("backend.megatron.use_flash_attention=false"))
    assert off.attention == "unfused" and off.path == "unfused" and not off.flash_style


def test_plan_does_not_depend_on_the_flash_attn_package(monkeypatch):
    """Item 7: forcing ``flash`` whenever flash_attn imports ended in item 1's error outside TE's supported
    flash-attn versions, and overrode TE's faster cuDNN choice on H100. The plan is TE's ``auto`` either way."""
    from hpc_tools.train.megatron import layers

    plans = []
    for has_flash in (True, False):
        monkeypatch.setattr(layers, "module_available", lambda name, f=has_flash: name != "flash_attn" or f)
        plans.append(layers.layer_plan(gpt3d(), "cuda"))
    assert plans[0] == plans[1] and plans[0].attention == "auto"


# TE v2.11 and main, dot_product_attention/utils.py get_attention_backend: FlashAttention 2/3 and FusedAttention are
# disabled for a qkv_dtype outside {bfloat16, float16} (float8 too for fused/FA3); UnfusedDotProductAttention takes
# any dtype. The backends TE could still pick for the recipe's precision:
TE_BACKENDS_FOR_PRECISION = {"fp32": {"UNFUSED"}, "bf16": {"FLASH", "FUSED", "UNFUSED"},
                             "fp16": {"FLASH", "FUSED", "UNFUSED"}}


def backends_mcore_leaves_on(monkeypatch, attention: str) -> set[str]:
    """The TE backends megatron-core leaves enabled for ``attention``: its own ``_set_attention_backend`` run on
    CPU (it only sets NVTE_FLASH_ATTN / NVTE_FUSED_ATTN / NVTE_UNFUSED_ATTN, which TE reads)."""
    import os

    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.transformer.enums import AttnBackend

    names = ("FLASH", "FUSED", "UNFUSED")
    for name in names:
        monkeypatch.delenv(f"NVTE_{name}_ATTN", raising=False)
    LanguageModule._set_attention_backend(SimpleNamespace(config=SimpleNamespace(
        attention_backend=AttnBackend[attention])))
    on = {name for name in names if os.environ[f"NVTE_{name}_ATTN"] == "1"}
    for name in names:
        monkeypatch.delenv(f"NVTE_{name}_ATTN")
    return on


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("flash", [True, False])
def test_every_precision_leaves_te_an_attention_backend(monkeypatch, precision, flash):
    """Item 1: with TE, fp32 had no attention backend (a pinned flash/fused backend, which TE refuses for fp32)."""
    r = gpt3d(f"training.precision={precision}", f"backend.megatron.use_flash_attention={str(flash).lower()}")
    plan = plan_of(r)
    usable = backends_mcore_leaves_on(monkeypatch, plan.attention) & TE_BACKENDS_FOR_PRECISION[precision]
    assert usable, f"{plan.describe()}: no TE attention backend for {precision}"
    # flash_style (selective recompute dropped, no s^2 in the plan) only where TE has a flash or fused kernel
    assert plan.flash_style == (flash and bool(usable & {"FLASH", "FUSED"}))
    assert ("fp32" in plan.note) == (precision == "fp32" and flash)


def test_the_old_pinned_backends_left_fp32_without_attention(monkeypatch):
    # the control: what layer_plan used to pick (flash, or fused without the flash-attn package) for every precision
    for pinned in ("flash", "fused"):
        assert not backends_mcore_leaves_on(monkeypatch, pinned) & TE_BACKENDS_FOR_PRECISION["fp32"]


def test_te_choice_is_read_from_tes_own_record():
    from hpc_tools.train.megatron.layers import describe_te_choice, te_attention_choice

    # the keys of TE's dot_product_attention._attention_backends (v2.11 and main)
    record = {"attention_params": object(), "use_flash_attention": False, "flash_attention_backend": None,
              "use_fused_attention": True, "fused_attention_backend": 1, "use_unfused_attention": True,
              "backend_selection_requires_update": False}
    assert describe_te_choice(record) == "te-fused (cuDNN, arbitrary sequence)"  # the attention path names
    assert describe_te_choice({**record, "use_fused_attention": False}) == "unfused"
    assert describe_te_choice({**record, "use_flash_attention": True, "flash_attention_backend": "2.8.3"}) == \
        "te-flash (flash-attn 2.8.3)"
    assert describe_te_choice({**record, "attention_params": None}) is None  # no forward yet
    assert te_attention_choice() is None  # no Transformer Engine on this machine


@pytest.mark.parametrize("sets", [
    ["backend.megatron.transformer_impl=transformer_engine", "backend.megatron.use_flash_attention=false"],
    ["backend.megatron.transformer_impl=transformer_engine"]])
def test_gpu_recipe_that_cannot_have_te_fails_in_one_line(sets):
    with pytest.raises(UserError) as err:
        plan_of(gpt3d(*sets), te=False)
    assert "transformer_impl=transformer_engine" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("sets, te", [([], False), (["backend.megatron.transformer_impl=local"], True)])
def test_flash_attention_on_local_layers_runs_sdpa(sets, te):
    """Issue 43: ``use_flash_attention: true`` on the local layers (auto without TE, or transformer_impl: local) was
    refused on a GPU; it now runs their attention on torch's SDPA, flash-style in 16-bit."""
    plan = plan_of(gpt3d(*sets), te=te)
    assert (plan.layers, plan.attention, plan.path, plan.flash_style) == ("local", "local", "sdpa", True)


def test_auto_without_te_falls_back_and_says_so():
    plan = plan_of(gpt3d("backend.megatron.use_flash_attention=false"), te=False)
    assert plan.layers == "local" and plan.attention == "local" and plan.path == "unfused"
    assert "transformer_engine not importable" in plan.describe()
    assert "transformer_engine not importable" in plan_of(gpt3d(), te=False).describe()  # (SDPA there)


def test_cpu_always_runs_local_layers_and_says_why():
    plan = plan_of(gpt3d(), device="cpu", te=True)
    assert (plan.layers, plan.attention, plan.path) == ("local", "local", "sdpa") and "CUDA-only" in plan.note


# -- checkpoints of the other layer kind (issue 25 item 5) ------------------------------------------------------------

def test_a_checkpoint_of_the_other_layer_kind_is_refused_in_one_line(tmp_path):
    """TE layers add ``_extra_state`` and fuse the norms into their linears: a local-layer checkpoint fails in
    dist_checkpointing with "Missing key", which the loop used to take for corruption. The layer kind is recorded in
    the layout meta and a mismatch is the user's one-line error (the loop re-raises a UserError, sets nothing
    aside)."""
    from hpc_tools.train.megatron.checkpoint import check_layers, layout_meta

    r = gpt3d()
    here = layout_meta(SimpleNamespace(layout=ParallelLayout.from_recipe(r), recipe=r, plan=plan_of(r)))
    assert here["layers"] == "transformer_engine"
    with pytest.raises(UserError) as err:
        check_layers(tmp_path, {**here, "layers": "local"}, here)
    assert "holds local layers" in str(err.value) and "transformer_impl: local" in str(err.value)
    assert "\n" not in str(err.value)
    check_layers(tmp_path, here, here)
    check_layers(tmp_path, {k: v for k, v in here.items() if k != "layers"}, here)  # written before the record


# -- the CUDA TransformerConfig, built on CPU (item 5, performance) ----------------------------------------------------

def cuda_config(recipe, te=True):
    from hpc_tools.train.megatron.config import transformer_config

    return transformer_config(recipe, ParallelLayout.from_recipe(recipe), "cuda", plan_of(recipe, te=te))


def test_cuda_config_turns_on_the_fusions_the_device_has():
    from megatron.core.transformer.enums import AttnBackend

    c = cuda_config(gpt3d())
    assert c.bias_activation_fusion and c.bias_dropout_fusion  # torch-jit kernels: any CUDA device
    assert not c.use_cpu_initialization
    assert c.attention_backend == AttnBackend.auto  # TE's own choice (issue 25 items 1, 7)
    assert not c.masked_softmax_fusion  # TE's attention ignores it
    assert not c.persist_layer_norm  # apex FusedLayerNorm only
    assert c.recompute_granularity is None  # selective recompute dropped: flash attention stores no s^2 tensor
    # interleaved (VPP2) on CUDA: p2p overlapped with compute, not batched (they exclude each other)
    assert c.overlap_p2p_comm and not c.batch_p2p_comm
    fp32 = cuda_config(gpt3d("training.precision=fp32"))  # TE runs its unfused attention: selective recompute kept
    assert fp32.attention_backend == AttnBackend.auto and fp32.recompute_granularity == "selective"


def test_cuda_config_for_llama_uses_te_rope_fusion_and_cpu_keeps_everything_off():
    from hpc_tools.train.megatron.config import fusions, p2p_options, transformer_config

    r = gpt3d("model.family=llama", "parallel.virtual_pipeline_size=null")
    # (TransformerConfig itself checks for TE's fused RoPE kernel at construction: only the kwargs here)
    f = fusions(r, "cuda", plan_of(r))
    assert f["apply_rope_fusion"] and f["bias_activation_fusion"] and f["bias_dropout_fusion"]
    assert p2p_options(ParallelLayout.from_recipe(r), "cuda") == {"batch_p2p_comm": True, "overlap_p2p_comm": False}
    local = plan_of(gpt3d("model.family=llama", "backend.megatron.use_flash_attention=false"), te=False)
    assert not fusions(r, "cuda", local)["apply_rope_fusion"]  # mcore raises for it without TE
    cpu = transformer_config(r, ParallelLayout.from_recipe(r), "cpu")
    assert not any([cpu.gradient_accumulation_fusion, cpu.bias_activation_fusion, cpu.masked_softmax_fusion,
                    cpu.bias_dropout_fusion, cpu.apply_rope_fusion, cpu.persist_layer_norm, cpu.overlap_p2p_comm])
    assert cpu.use_cpu_initialization and cpu.recompute_granularity == "selective"


def test_gradient_accumulation_fusion_only_with_apex_kernel():
    # megatron-core's ColumnParallelLinear raises without apex's fused_weight_gradient_mlp_cuda, even under TE
    from hpc_tools.train.megatron.layers import module_available

    assert cuda_config(gpt3d()).gradient_accumulation_fusion == module_available("fused_weight_gradient_mlp_cuda")


def test_missing_apex_is_noted_at_start_on_cuda_only(monkeypatch):
    """Item 13: without apex TE's weight-gradient fusion is off too (mcore passes gradient_accumulation_fusion to TE's
    fuse_wgrad_accumulation); the run says so where it starts (``MegatronCore.notes``, logged by the trainer)."""
    from hpc_tools.train.megatron import config

    r = gpt3d()
    assert config.fusion_notes(r, "cpu") == []
    for has_apex in (False, True):
        monkeypatch.setattr(config, "module_available", lambda name, a=has_apex: a)
        notes = config.fusion_notes(r, "cuda")
        assert notes == ([] if has_apex else [config.NO_APEX_NOTE])
        assert cuda_config(r).gradient_accumulation_fusion == has_apex
    assert "Transformer Engine's weight-gradient fusion" in config.NO_APEX_NOTE


def test_cuda_device_max_connections_by_layout():
    from hpc_tools.train.megatron.config import cuda_device_max_connections

    r = gpt3d()
    assert cuda_device_max_connections(r, ParallelLayout.from_recipe(r)) == "1"
    flat = gpt3d("parallel.tensor_size=1", "parallel.sequence_parallel=false", "parallel.pipeline_size=1",
                 "parallel.virtual_pipeline_size=null", "backend.megatron.overlap_grad_reduce=false",
                 "backend.megatron.overlap_param_gather=false")
    assert cuda_device_max_connections(flat, ParallelLayout.from_recipe(flat)) is None


# -- device choice (items 6, 7) ----------------------------------------------------------------------------------------

def context_for(recipe, local_rank=0):
    from hpc_tools.runtime.context import RankContext

    return RankContext(recipe=recipe, layout=ParallelLayout.from_recipe(recipe),
                       dist=SimpleNamespace(local_rank=local_rank, rank=local_rank), run=None)


def test_gpu_recipe_without_cuda_fails_with_the_reason(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError) as err:
        context_for(gpt3d()).device
    msg = str(err.value)
    assert "cluster.gpu_type=H100-SXM" in msg and "torch.cuda.is_available() is False" in msg and "\n" not in msg
    assert ("CPU-only build" in msg) == (torch.version.cuda is None)


def test_cpu_recipe_and_local_profile_stay_on_cpu():
    local = load_recipe(REPO_RECIPE, profile="local")  # README's first command runs this profile
    assert local.cluster.gpu_type == "cpu"
    assert context_for(local).device.type == "cpu"


@pytest.mark.parametrize("local_rank,visible,expected", [(5, 8, 5), (3, 1, 0), (6, 4, 2)])
def test_device_index_is_local_rank_modulo_visible_gpus(monkeypatch, local_rank, visible, expected):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    assert context_for(gpt3d(), local_rank).device == torch.device("cuda", expected)
    import os

    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"  # TP2 + SP + overlaps rely on it
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")


# -- DeepSpeed on GPU (item 10) ----------------------------------------------------------------------------------------

def ds_recipe(gpu_type="H100-SXM", stage=2, offload="cpu", precision="bf16"):
    return resolve({
        "name": "ds", "model": {"family": "gpt", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                "seq_length": 32, "vocab_size": 512},
        "training": {"micro_batch_size": 1, "global_batch_size": 8, "precision": precision},
        "backend": {"kind": "deepspeed", "deepspeed": {"zero_stage": stage, "offload_optimizer": offload}},
        "cluster": {"gpus_per_node": 2, "gpu_type": gpu_type}})


def test_ds_offload_on_gpu_uses_cpu_adam_and_pinned_memory():
    from hpc_tools.train.deepspeed.ds_config import build_ds_config, render

    r = ds_recipe()
    cfg = json.loads(render(build_ds_config(r, ParallelLayout.from_recipe(r))))
    assert "torch_adam" not in cfg["optimizer"]["params"]  # deepspeed then builds DeepSpeedCPUAdam for the offload
    assert cfg["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}


def test_ds_cpu_runs_keep_torch_adamw_and_unpinned_buffers():
    from hpc_tools.train.deepspeed.ds_config import build_ds_config

    r = ds_recipe(gpu_type="cpu")
    cfg = build_ds_config(r, ParallelLayout.from_recipe(r))
    assert cfg["optimizer"]["params"]["torch_adam"] is True
    assert cfg["zero_optimization"]["offload_optimizer"]["pin_memory"] is False
    no_offload = ds_recipe(offload="none")
    assert build_ds_config(no_offload, ParallelLayout.from_recipe(no_offload))["optimizer"]["params"]["torch_adam"]


@pytest.mark.parametrize("stage,offload,precision,fp32_accum", [
    (1, "none", "bf16", True), (0, "none", "bf16", False), (2, "none", "bf16", False), (1, "cpu", "bf16", False),
    (1, "none", "fp32", False)])
def test_ds_grad_accumulation_in_fp32_where_deepspeed_honours_it(stage, offload, precision, fp32_accum):
    from hpc_tools.train.deepspeed.ds_config import build_ds_config

    r = ds_recipe(stage=stage, offload=offload, precision=precision)
    cfg = build_ds_config(r, ParallelLayout.from_recipe(r))
    assert (cfg.get("data_types") == {"grad_accum_dtype": "fp32"}) == fp32_accum


def test_ds_rank_environment_names_the_ranks_own_device():
    """Issue 25 items 6, 8: DeepSpeed takes LOCAL_RANK for the CUDA index and picks CUDA whenever torch sees a GPU;
    the rank's device decides both."""
    import torch

    from hpc_tools.train.deepspeed.device import environment_for

    env = {"LOCAL_RANK": "3"}  # Slurm's local id, one GPU per task
    assert environment_for(torch.device("cuda", 0), env) == {"DS_ACCELERATOR": "cuda", "LOCAL_RANK": "0"}
    assert env["LOCAL_RANK"] == "0"
    env = {"LOCAL_RANK": "3"}
    assert environment_for(torch.device("cpu"), env) == {"DS_ACCELERATOR": "cpu"} and env["LOCAL_RANK"] == "3"
    with pytest.raises(UserError) as err:
        environment_for(torch.device("cpu"), {"DS_ACCELERATOR": "cuda"})
    assert "DS_ACCELERATOR=cuda" in str(err.value) and "\n" not in str(err.value)


def test_deepspeed_follows_the_rank_environment_on_a_machine_with_a_gpu():
    """DeepSpeed's own code (a child process: its accelerator is cached per process), with torch made to report one
    visible GPU: without ``environment_for`` a CPU rank would get DeepSpeed's CUDA accelerator (the control); with
    it, the CPU one. And a one-GPU-per-task CUDA rank with Slurm's LOCAL_RANK=3 gets device 0 from DeepSpeed's
    engine (``_configure_with_arguments`` + ``_set_distributed_vars``; the accelerator's set_device recorded)."""
    code = textwrap.dedent("""
        import json, os, torch
        from types import SimpleNamespace
        torch.cuda.is_available = lambda: True
        torch.cuda.device_count = lambda: 1
        os.environ["LOCAL_RANK"] = "3"
        os.environ.pop("DS_ACCELERATOR", None)
        from deepspeed.accelerator import real_accelerator
        out = {"auto": real_accelerator.get_accelerator().device_name()}
        real_accelerator.ds_accelerator = None
        from hpc_tools.train.deepspeed.device import check_accelerator, environment_for
        environment_for(torch.device("cpu"))
        out["cpu rank"] = real_accelerator.get_accelerator().device_name()
        check_accelerator(torch.device("cpu"))
        import deepspeed.runtime.engine as eng
        calls = []
        eng.get_accelerator = lambda: SimpleNamespace(set_device=calls.append, device_name=lambda i: "cpu")
        eng.dist = SimpleNamespace(get_world_size=lambda: 1, get_rank=lambda: 0)
        os.environ.pop("DS_ACCELERATOR")  # this process now plays a CUDA rank
        for env_local_rank in ("3", environment_for(torch.device("cuda", 0), os.environ)["LOCAL_RANK"]):
            os.environ["LOCAL_RANK"] = env_local_rank
            engine = SimpleNamespace()
            eng.DeepSpeedEngine._configure_with_arguments(engine, None, None)
            eng.DeepSpeedEngine._set_distributed_vars(engine, None)
        out["set_device"] = calls
        print(json.dumps(out))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["auto"] == "cuda", "the control: DeepSpeed picks CUDA when torch sees a GPU"
    assert out["cpu rank"] == "cpu"
    assert out["set_device"] == [3, 0]  # Slurm's id as DeepSpeed would use it, then the rank's device index


def _strict_pinning(monkeypatch):
    """CUDA's pin_memory, as far as a CPU build can show it: it refuses a tensor whose elements share memory (an
    expand's stride 0: "more than one element of the written-to tensor refers to a single memory location", the first
    step of every Megatron GPU run while positions were pinned) and returns a page-locked copy (here: a clone)."""
    import torch

    pinned = []

    def pin_memory(t):
        if any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride())):
            raise RuntimeError("unsupported operation: more than one element of the written-to tensor refers to a "
                               "single memory location")
        pinned.append(tuple(t.shape))
        return t.clone()

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda t: False)
    return pinned


def test_every_backend_copies_batches_from_pinned_memory_and_never_pins_an_expand(monkeypatch):
    """Issue 25 item 12 and the first H200 run (every Megatron step failed in pin_memory): one host-to-device copy
    for all backends (pin unless pinned, then non-blocking); the Megatron batch's positions are made on the device,
    and a repeated view is made contiguous before it is pinned. ``meta`` stands for the accelerator (pinning needs
    CUDA; the GPU smoke runs the real copy)."""
    import torch

    from hpc_tools.train.megatron.engine import MegatronCore
    from hpc_tools.train.prefetch import pin_batch, to_device

    pinned = _strict_pinning(monkeypatch)
    meta = torch.device("meta")
    tokens = torch.arange(12).reshape(3, 4)
    out = MegatronCore._prepare({"tokens": tokens, "labels": tokens + 1}, meta)
    assert {k: (v.device.type, tuple(v.shape)) for k, v in out.items()} == {
        "tokens": ("meta", (3, 4)), "labels": ("meta", (3, 4)), "position_ids": ("meta", (3, 4))}
    assert pinned == [(3, 4), (3, 4)]  # tokens and labels; positions never leave the device
    expanded = torch.arange(4).unsqueeze(0).expand(3, 4)
    assert to_device(expanded, meta).shape == (3, 4)
    assert torch.equal(pin_batch([{"p": expanded, "n": 1}])[0]["p"], expanded)
    cpu = torch.ones(2)
    assert to_device(cpu, torch.device("cpu")) is cpu
    assert torch.equal(MegatronCore._prepare({"tokens": tokens, "labels": tokens}, torch.device("cpu"))["position_ids"],
                       torch.arange(4).expand(3, 4))


# -- per-stage seeds (item 8) ------------------------------------------------------------------------------------------

def test_each_pipeline_stage_tp_rank_and_ep_rank_gets_its_own_streams():
    """Runs megatron-core's real seeding (cpu_compat routes the CUDA tracker to CPU generator states) in a child
    process, since cpu_compat patches torch process-wide."""
    code = textwrap.dedent("""
        import json, torch
        from hpc_tools.train.megatron import cpu_compat
        cpu_compat.install()
        from megatron.core import tensor_parallel
        from hpc_tools.train.megatron.engine import seed_streams
        out = {}
        for pp in range(2):
            for tp in range(2):
                for ep in range(2):
                    seed_streams(1234, pp, tp, ep_rank=ep, etp_rank=0)
                    cpu = torch.rand(4).tolist()
                    tracker = tensor_parallel.get_cuda_rng_tracker().get_states()
                    out[f"{pp},{tp},{ep}"] = {"cpu": cpu, **{k: torch.as_tensor(v).float().sum().item()
                                                             for k, v in tracker.items()}}
        print(json.dumps(out))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = {k[:-2]: v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items() if k.endswith(",0")}
    experts = json.loads(proc.stdout.strip().splitlines()[-1])
    streams = [name for name in out["0,0"] if name != "cpu"]
    assert "model-parallel-rng" in streams and "expert-parallel-rng" in streams
    # every stream differs between the stages; the tensor-parallel stream also between TP ranks
    for name in streams + ["cpu"]:
        assert out["0,0"][name] != out["1,0"][name] and out["0,1"][name] != out["1,1"][name], name
    assert out["0,0"]["model-parallel-rng"] != out["0,1"]["model-parallel-rng"]
    # the expert stream differs between expert-parallel ranks (each draws its own experts), the others do not
    for key in ("0,0", "1,1"):
        a, b = experts[key + ",0"], experts[key + ",1"]
        assert a["expert-parallel-rng"] != b["expert-parallel-rng"]
        assert all(a[n] == b[n] for n in streams + ["cpu"] if n != "expert-parallel-rng")
    # the CPU generator of stage 0 is seeded as before (seed + 100 * pp): the CPU equality tests rely on it
    import torch

    torch.manual_seed(1234)
    assert out["0,0"]["cpu"] == torch.rand(4).tolist()


def test_megatron_groups_get_the_watchdogs_timeout_not_30_minutes():
    """Item 4: megatron-core creates its process groups with its own 30-minute default; the engine passes the
    world's timeout (``RankContext.collective_timeout``: cluster.hang_timeout_min + the margin), so a hang in load or
    the first step reaches the watchdog first. Real mcore groups on a 1-rank gloo world, read back from torch."""
    code = textwrap.dedent("""
        import json, os, torch, torch.distributed as dist
        from datetime import timedelta
        from types import SimpleNamespace
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29000 + os.getpid() % 1000))
        from hpc_tools.train.megatron import cpu_compat
        cpu_compat.install()
        from megatron.core import parallel_state as ps
        from hpc_tools.train.megatron.engine import init_parallel
        dist.init_process_group("gloo", rank=0, world_size=1)
        layout = SimpleNamespace(megatron_sizes=lambda: {"tensor_model_parallel_size": 1,
                                                         "pipeline_model_parallel_size": 1,
                                                         "virtual_pipeline_model_parallel_size": None})
        out = {}
        for name, timeout in (("default", None), ("watchdog", timedelta(minutes=12.5))):
            init_parallel(layout, 1234, timeout)
            groups = [ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group(),
                      ps.get_pipeline_model_parallel_group()]
            out[name] = sorted({g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in groups})
            ps.destroy_model_parallel()
        print(json.dumps(out))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"default": [1800.0], "watchdog": [750.0]}
    from hpc_tools.runtime.context import RankContext

    ctx = RankContext(recipe=gpt3d("cluster.hang_timeout_min=7.5"), layout=None, dist=None, run=None)
    assert ctx.collective_timeout.total_seconds() > 7.5 * 60  # what the trainer passes: beyond the watchdog's


def test_te_apex_warning_hidden_on_cpu_only():
    import warnings

    from hpc_tools.train.megatron.trainer import _quiet_megatron

    def hidden() -> bool:
        text = "Transformer Engine and Apex are not installed"
        return any(f[0] == "ignore" and f[1] is not None and f[1].search(text) for f in warnings.filters)

    with warnings.catch_warnings():
        _quiet_megatron("cuda")
        assert not hidden()  # on a GPU the slow-path warning stays visible
        _quiet_megatron("cpu")
        assert hidden()
