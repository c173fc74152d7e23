"""The ``sdpa`` attention path (issue 43 item 1): ``SDPAttention`` against megatron-core's own ``DotProductAttention``
on random inputs (one process, TP=1: outputs and the gradients of Q, K and V, causal and with an explicit mask,
multi-head and grouped-query, fp32 and bf16, query-key layer scaling), what it refuses, and the layer plan that
chooses it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from hpc_tools.errors import UserError
from hpc_tools.recipe.load import load_recipe

pytestmark = pytest.mark.megatron

COMPARE = textwrap.dedent("""
    import json, sys, warnings; warnings.filterwarnings("ignore")
    import torch, torch.distributed as dist
    from hpc_tools.train.megatron import cpu_compat
    cpu_compat.import_megatron(); cpu_compat.install()
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig
    from hpc_tools.errors import UserError
    from hpc_tools.train.megatron.sdpa_attention import SDPAttention

    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    ps.initialize_model_parallel()
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    model_parallel_cuda_manual_seed(1)
    H, D, S, B = 8, 16, 24, 3

    def config(groups, dtype, **extra):
        return TransformerConfig(num_layers=2, hidden_size=H * D, num_attention_heads=H, num_query_groups=groups,
                                 kv_channels=D, attention_softmax_in_fp32=True, use_cpu_initialization=True,
                                 params_dtype=dtype, bf16=dtype == torch.bfloat16,
                                 **{"attention_dropout": 0.0, **extra})

    def run(cls, cfg, groups, mask_type, mask, dtype, seed):
        torch.manual_seed(seed)
        q = torch.randn(S, B, H, D, dtype=dtype, requires_grad=True)
        k = torch.randn(S, B, groups, D, dtype=dtype, requires_grad=True)
        v = torch.randn(S, B, groups, D, dtype=dtype, requires_grad=True)
        module = cls(cfg, layer_number=2, attn_mask_type=mask_type, attention_type="self")
        out = module(q, k, v, mask)
        out.float().pow(2).sum().backward()
        return [out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()]

    results = {}
    for groups in (8, 2, 1):
        for dtype in (torch.float32, torch.bfloat16):
            for masked in (False, True):
                for scaling in (False, True):
                    cfg = config(groups, dtype, apply_query_key_layer_scaling=scaling)
                    mask_type = AttnMaskType.padding if masked else AttnMaskType.causal
                    mask = None
                    if masked:  # megatron's convention: True = masked out; the diagonal stays visible
                        g = torch.Generator().manual_seed(groups)
                        mask = (torch.rand(B, 1, S, S, generator=g) < 0.4) & ~torch.eye(S, dtype=torch.bool)
                    want = run(DotProductAttention, cfg, groups, mask_type, mask, dtype, 7)
                    got = run(SDPAttention, cfg, groups, mask_type, mask, dtype, 7)
                    name = f"groups={groups} {str(dtype)[6:]} {'mask' if masked else 'causal'} scaling={scaling}"
                    results[name] = {"shape": list(got[0].shape),
                                     "diff": max((a - b).abs().max().item() for a, b in zip(got, want)),
                                     "scale": max(b.abs().max().item() for b in want)}
    # dropout: applied in training (the output changes), not in evaluation (equal to megatron's)
    cfg = config(2, torch.float32, attention_dropout=0.5)
    torch.manual_seed(3)
    q, k, v = torch.randn(S, B, H, D), torch.randn(S, B, 2, D), torch.randn(S, B, 2, D)
    sdpa, ref = (cls(cfg, 1, AttnMaskType.causal, "self") for cls in (SDPAttention, DotProductAttention))
    trained = sdpa(q, k, v, None)
    sdpa.eval(); ref.eval()
    results["dropout"] = {"eval_diff": (sdpa(q, k, v, None) - ref(q, k, v, None)).abs().max().item(),
                          "train_diff": (trained - sdpa(q, k, v, None)).abs().max().item()}
    refused = []
    for extra in ({"softmax_type": "off-by-one"}, {"window_size": (4, 0)}):
        try:
            SDPAttention(config(8, torch.float32, **extra), 1, AttnMaskType.causal, "self")
        except UserError as err:
            refused.append(str(err))
    try:
        sdpa(q, k, v, None, attention_bias=torch.zeros(1))
    except UserError as err:
        refused.append(str(err))
    results["refused"] = refused
    print(json.dumps(results))
    dist.destroy_process_group()
""")


@pytest.fixture(scope="module")
def compared(tmp_path_factory) -> dict:
    pg = tmp_path_factory.mktemp("sdpa") / "pg"
    proc = subprocess.run([sys.executable, "-c", COMPARE, str(pg)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_sdpa_equals_megatrons_dot_product_attention_on_random_inputs(compared):
    cases = {k: v for k, v in compared.items() if k.startswith("groups=")}
    assert len(cases) == 24
    for name, r in cases.items():
        assert r["shape"] == [24, 3, 8 * 16], name  # [s, b, heads x head_dim], as megatron's
        # fp32: the same sums in another order; bf16: both round Q.K^T and P.V to bf16 at different points
        tol = 2e-5 if "float32" in name else 0.03
        assert r["diff"] <= tol * max(1.0, r["scale"]), (name, r)


def test_dropout_is_applied_in_training_only(compared):
    assert compared["dropout"]["eval_diff"] < 1e-5 and compared["dropout"]["train_diff"] > 0.1, compared["dropout"]


def test_what_sdpa_cannot_compute_is_refused_in_one_line(compared):
    softmax, window, bias = compared["refused"]
    for line in (softmax, window, bias):
        assert "\n" not in line and "use_flash_attention: false" in line
    assert softmax.startswith("softmax_type=off-by-one needs a softmax offset")
    assert window.startswith("window_size=(4, 0) (sliding-window attention)")
    assert "attention bias" in bias


GPT = "recipes/gpt_3d.yaml"


def plan(device: str, *sets: str, te: bool | None = None):
    from hpc_tools.train.megatron.layers import layer_plan

    return layer_plan(load_recipe(GPT, overrides=list(sets), check=False), device, te_available=te)


@pytest.mark.parametrize("sets, te, path, flash_style", [
    ([], False, "sdpa", True),  # auto without TE on a GPU: local layers, SDPA (before: refused)
    (["backend.megatron.transformer_impl=local"], True, "sdpa", True),  # local + flash (before: refused)
    (["backend.megatron.transformer_impl=local", "training.precision=fp32"], False, "sdpa", False),
    (["backend.megatron.use_flash_attention=false"], False, "unfused", False),
    ([], True, "te-flash|te-fused", True),
    (["training.precision=fp32"], True, "unfused", False),  # TE runs its unfused attention in fp32
    (["backend.megatron.use_flash_attention=false"], True, "unfused", False),
])
def test_gpu_layer_plan_names_the_attention_path(sets, te, path, flash_style):
    p = plan("cuda", *sets, te=te)
    assert (p.path, p.flash_style) == (path, flash_style)
    assert p.sdpa == (path == "sdpa") and p.transformer_engine == (path != "sdpa" and te)
    assert f"attention={path}" in p.describe()


@pytest.mark.parametrize("flash, path", [(True, "sdpa"), (False, "unfused")])
def test_cpu_ranks_run_sdpa_when_flash_attention_is_asked_for(flash, path):
    p = plan("cpu", f"backend.megatron.use_flash_attention={str(flash).lower()}")
    assert (p.layers, p.attention, p.path, p.flash_style) == ("local", "local", path, False)


def test_context_parallelism_on_the_sdpa_path_is_refused_in_one_line():
    from hpc_tools.layout import ParallelLayout
    from hpc_tools.train.megatron.config import context_options

    r = load_recipe(GPT, overrides=["parallel.context_size=2", "backend.megatron.transformer_impl=local"],
                    check=False)
    p = plan("cuda", "backend.megatron.transformer_impl=local", te=True)
    with pytest.raises(UserError) as err:
        context_options(ParallelLayout.from_recipe(r), p)
    line = str(err.value)
    assert "\n" not in line and line.startswith("parallel.context_size=2 needs Transformer Engine's attention")
    assert "sdpa" in line and "context_size: 1" in line
