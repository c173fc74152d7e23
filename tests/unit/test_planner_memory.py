"""Memory model against the published examples: the ZeRO paper's 7.5B / 64-GPU table, Megatron's bytes per
parameter, Korthikanti et al. Table 2 for every configuration, and the pipeline in-flight rules."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hpc_tools.layout import ParallelLayout
from hpc_tools.planner.arch import Arch
from hpc_tools.planner.knobs import Knobs
from hpc_tools.planner.memory import (
    ACTIVATIONS,
    first_chunk_in_flight,
    layer_activation_bytes,
    layer_bytes,
    megatron_layer_terms,
    stage_activation_bytes,
    stage_memory,
)
from hpc_tools.planner.sharding import MegatronKnobs, megatron_state_bytes, zero_state_bytes

GB = 1e9


# --- ZeRO paper (Rajbhandari et al. 2019): Psi = 7.5 B, N_d = 64: 120 GB -> 31.4 -> 16.6 -> 1.9 -------------------

@pytest.mark.parametrize("stage, published_gb, exact_bytes", [
    (0, 120.0, 16 * 7.5e9),
    (1, 31.4, 4 * 7.5e9 + 12 * 7.5e9 / 64),
    (2, 16.6, 2 * 7.5e9 + 14 * 7.5e9 / 64),
    (3, 1.9, 16 * 7.5e9 / 64),
])
def test_zero_paper_table(stage, published_gb, exact_bytes):
    total = sum(zero_state_bytes(7.5e9, 64, stage, "bf16"))
    assert total == pytest.approx(exact_bytes, rel=1e-15)
    assert round(total / GB, 1) == published_gb


def test_zero_offload_moves_states_off_the_gpu():
    params, grads, optim = zero_state_bytes(7.5e9, 64, 3, "bf16", offload_optimizer="cpu", offload_param="cpu")
    assert (params, optim) == (0.0, 0.0) and grads == pytest.approx(2 * 7.5e9 / 64)
    assert zero_state_bytes(1e9, 8, 2, "bf16", offload_optimizer="cpu")[2] == 0.0


def test_megatron_bytes_per_parameter():
    assert sum(megatron_state_bytes(1, 8, "bf16", distributed_optimizer=False)) == 18
    for d in (1, 2, 8, 64):
        assert sum(megatron_state_bytes(1, d, "bf16", distributed_optimizer=True)) == pytest.approx(6 + 12 / d)
        assert sum(megatron_state_bytes(1, d, "fp32", distributed_optimizer=True)) == pytest.approx(8 + 8 / d)


# --- Korthikanti et al. 2022, Table 2 (bytes per layer, 16-bit activations) -----------------------------------------

TABLE2 = {
    "no parallelism": (dict(t=1), lambda s, b, h, a, t: s * b * h * (34 + 5 * a * s / h)),
    "tensor parallel": (dict(), lambda s, b, h, a, t: s * b * h * (10 + 24 / t + 5 * a * s / (h * t))),
    "tensor + sequence parallel": (dict(sp=True), lambda s, b, h, a, t: s * b * h / t * (34 + 5 * a * s / h)),
    "tensor parallel + selective recompute": (dict(recompute="selective"),
                                              lambda s, b, h, a, t: s * b * h * (10 + 24 / t)),
    "tensor + sequence parallel + selective recompute": (dict(sp=True, recompute="selective"),
                                                         lambda s, b, h, a, t: 34 * s * b * h / t),
    "full recompute": (dict(recompute="full"), lambda s, b, h, a, t: 2 * s * b * h),
}
# GPT-3 175B and the paper's 22B / 530B / 1T configurations (its Table 3), plus a small odd one.
SHAPES = [(2048, 1, 12288, 96, 8), (2048, 4, 6144, 64, 8), (2048, 1, 20480, 128, 8), (2048, 1, 25600, 160, 8),
          (1024, 3, 1536, 12, 2)]


@pytest.mark.parametrize("config", list(TABLE2))
@pytest.mark.parametrize("s, b, h, a, t", SHAPES)
def test_korthikanti_table2(config, s, b, h, a, t):
    options, formula = TABLE2[config]
    kwargs = {k: v for k, v in options.items() if k != "t"}
    t = options.get("t", t)
    got = layer_activation_bytes(s, b, h, a, t, **kwargs)  # MHA, GELU, ffn 4h, dropout, explicit attention
    assert got == pytest.approx(formula(s, b, h, a, t), rel=1e-12)


def test_fused_attention_drops_exactly_the_s2_terms():
    s, b, h, a, t = 2048, 2, 4096, 32, 4
    explicit = layer_activation_bytes(s, b, h, a, t)
    assert explicit - layer_activation_bytes(s, b, h, a, t, flash=True) == pytest.approx(5 * a * s * s * b / t)


def test_generalisations_change_only_their_terms():
    s, b, h, a, t = 1024, 1, 4096, 32, 2
    base = layer_activation_bytes(s, b, h, a, t, flash=True)
    # GQA with 8 groups: K and V shrink from 2sbh each to 2sbh * g/a each (sharded by t)
    gqa = layer_activation_bytes(s, b, h, a, t, groups=8, flash=True)
    assert base - gqa == pytest.approx(2 * 2 * s * b * h * (1 - 8 / a) / t)
    # SwiGLU with ffn f: fc1 output 2f + silu f + product f, 2 bytes each, instead of GELU's f + f
    f = 11008
    swiglu = layer_activation_bytes(s, b, h, a, t, ffn=f, gated=True, flash=True)
    gelu = layer_activation_bytes(s, b, h, a, t, ffn=f, flash=True)
    assert swiglu - gelu == pytest.approx(2 * 2 * s * b * f / t)
    # no dropout: the two 1-byte sbh masks vanish (and with explicit attention the mask + dropout output, 3as^2b)
    no_dropout = layer_activation_bytes(s, b, h, a, t, flash=True, hidden_dropout=False)
    assert base - no_dropout == pytest.approx(2 * s * b * h)
    explicit = layer_activation_bytes(s, b, h, a, t)
    no_attn_dropout = layer_activation_bytes(s, b, h, a, t, attention_dropout=False)
    assert explicit - no_attn_dropout == pytest.approx(3 * a * s * s * b / t)


def test_megatron_implementation_details():
    s, b, h, a, t = 512, 2, 1024, 16, 2
    plain = layer_activation_bytes(s, b, h, a, t, attention_dropout=False)
    fp32 = layer_activation_bytes(s, b, h, a, t, attention_dropout=False, softmax_fp32=True)
    assert fp32 - plain == pytest.approx(4 * a * s * s * b / t)  # fp32 softmax (4) + 16-bit copy (2) instead of 2
    dropped = layer_activation_bytes(s, b, h, a, t, softmax_fp32=True) - layer_activation_bytes(s, b, h, a, t)
    assert dropped == pytest.approx(2 * a * s * s * b / t)  # fp32 softmax (4) instead of 2; mask + output as before
    gqa = layer_activation_bytes(s, b, h, a, t, groups=4, attention_dropout=False)
    expanded = layer_activation_bytes(s, b, h, a, t, groups=4, attention_dropout=False, expand_kv=True)
    assert expanded - gqa == pytest.approx(2 * 2 * s * b * (h / a) * (a - 4) / t)  # K and V at a heads, not 4
    assert layer_activation_bytes(s, b, h, a, t, groups=4, flash=True, expand_kv=True) == pytest.approx(
        layer_activation_bytes(s, b, h, a, t, groups=4, flash=True))  # fused attention reads the groups directly
    f = 2816
    glu = layer_activation_bytes(s, b, h, a, t, ffn=f, gated=True, flash=True, glu_offset_copy=True)
    gated = layer_activation_bytes(s, b, h, a, t, ffn=f, gated=True, flash=True)
    assert glu - gated == pytest.approx(2 * s * b * f / t)


# --- pipeline: in-flight microbatches, interleaving -----------------------------------------------------------------

def _arch(layers=32, hidden=1024, heads=16):
    return Arch(layers=layers, hidden=hidden, heads=heads, groups=heads, head_dim=hidden // heads, ffn=4 * hidden,
                seq=1024, vocab=50257, gated=False, norm_params_per_h=2, bias=True, learned_positions=True, tied=True,
                hidden_dropout=True, attention_dropout=True)


def _knobs(t=1, p=1, v=None, d=1, b=1, batch=64, recompute="none", **kw):
    lay = ParallelLayout(nodes=1, ranks_per_node=t * p * d, tensor_size=t, pipeline_size=p, data_size=d,
                         virtual_pipeline_size=v, sequence_parallel=t > 1, micro_batch_size=b, global_batch_size=batch)
    return Knobs(backend="megatron", layout=lay, precision="bf16", recompute=recompute, flash=True,
                 sharding=MegatronKnobs(distributed_optimizer=False, overlap_grad_reduce=False,
                                        overlap_param_gather=False), **kw)


def test_first_stage_holds_p_microbatches_of_its_layers():
    arch = _arch()
    per_layer = layer_bytes(arch, _knobs(t=2, batch=64), "none")
    for p in (2, 4, 8):
        acts, _ = stage_activation_bytes(arch, _knobs(t=2, p=p, batch=64), 0)
        assert acts == pytest.approx(arch.layers * per_layer)  # (L/p layers) x p microbatches
        last, _ = stage_activation_bytes(arch, _knobs(t=2, p=p, batch=64), p - 1)
        assert last == pytest.approx(arch.layers / p * per_layer)  # one microbatch
    few, _ = stage_activation_bytes(arch, _knobs(t=2, p=8, batch=2), 0)  # m = 2 < p: only 2 in flight
    assert few == pytest.approx(arch.layers / 8 * 2 * per_layer)


@pytest.mark.parametrize("p, v", [(2, 2), (4, 2), (4, 4), (8, 2)])
def test_interleaving_multiplies_by_korthikanti_factor(p, v):
    arch = _arch()
    plain, _ = stage_activation_bytes(arch, _knobs(t=2, p=p, batch=64), 0)
    inter, _ = stage_activation_bytes(arch, _knobs(t=2, p=p, v=v, batch=64), 0)
    assert inter / plain == pytest.approx(1 + (p - 1) / (p * v))


def test_full_recompute_keeps_layer_inputs_plus_one_group():
    arch = _arch()
    k = _knobs(t=2, p=1, recompute="full")
    acts, working = stage_activation_bytes(arch, k, 0)
    assert acts == pytest.approx(arch.layers * 2 * 1024 * 1024 / 2)  # 2sbh/t per layer (SP)
    assert working == pytest.approx(layer_bytes(arch, k, "none"))
    grouped, working4 = stage_activation_bytes(arch, replace(k, recompute_num_layers=4), 0)
    assert grouped == pytest.approx(acts / 4) and working4 == pytest.approx(4 * working)
    block, _ = stage_activation_bytes(arch, replace(k, recompute_method="block", recompute_num_layers=8), 0)
    full_layer = layer_bytes(arch, k, "none")
    assert block == pytest.approx(8 * 1024 * 1024 + 24 * full_layer)


def test_stage_memory_puts_embeddings_first_and_output_last():
    arch = replace(_arch(), tied=False)
    k = _knobs(p=4, batch=64)
    first, last = stage_memory(arch, k, 0), stage_memory(arch, k, 3)
    assert first.terms[ACTIVATIONS] > last.terms[ACTIVATIONS]
    assert first.params - last.params == arch.padded_vocab(1) * arch.hidden + arch.seq * arch.hidden - (
        arch.padded_vocab(1) * arch.hidden + 2 * arch.hidden)  # word + positions vs output layer + final norm
    assert first.total == pytest.approx(sum(first.terms.values()))


def test_embedding_chunk_in_flight_follows_the_interleaved_order():
    """Stage 0 runs chunk 0 for p microbatches, then chunk 1, ...; backwards run the chunks in reverse, so during the
    steady state up to 2p microbatches hold the embedding chunk (p = 4, v = 2, m = 8: warm-up 10 forwards, 6 of
    them chunk 0; two more chunk-0 forwards before the first chunk-0 backward)."""
    assert first_chunk_in_flight(4, 1, 8) == 4 and first_chunk_in_flight(4, 1, 2) == 2
    assert first_chunk_in_flight(4, 2, 8) == 8
    assert first_chunk_in_flight(2, 2, 2) == 2  # m = p: never more than the m microbatches


def test_fused_qkv_output_stays_alive_through_views():
    """MHA without RoPE: Q, K and V are views of the fused QKV output (3 a heads); RoPE writes new Q and K, but V
    still keeps the whole QKV output (5 a heads); GQA expands K and V to a heads in the explicit attention (3 a)."""
    s, b, h, a, e, dh = 64, 2, 256, 8, 2, 32
    key = "Q, K, V (+ fused QKV output kept by views)"

    def qkv(**kw):
        return megatron_layer_terms(s, b, h, a, flash=False, act_bytes=e, **kw)[key] / (e * s * b * dh)

    assert qkv() == 3 * a
    assert qkv(rope=True) == 5 * a
    assert qkv(groups=2, rope=True) == 3 * a
    assert qkv(groups=2, recompute="selective", rope=True) == (a + 2 * 2) + (a + 2)  # QKV output + new Q and K
    assert qkv(groups=1, recompute="selective") == a + 2  # views only: the grouped layout with g = 1 is a view
    assert qkv(groups=2, recompute="selective") == (a + 4) + a  # 1 < g < a: Q is a copy


@pytest.mark.parametrize("precision, impl, sets, flash, path", [
    ("bf16", "auto", [], True, "te"), ("fp16", "transformer_engine", [], True, "te"),
    ("fp32", "auto", [], False, "te-unfused"),
    ("bf16", "local", [], True, "sdpa"),  # torch's SDPA on the local layers (issue 43): flash-style in 16-bit
    ("fp32", "local", [], False, "sdpa"),
    ("bf16", "local", ["backend.megatron.use_flash_attention=false"], False, "unfused"),
    ("bf16", "auto", ["cluster.gpu_type=cpu"], False, "sdpa")])
def test_megatron_plans_fused_attention_only_where_te_has_a_fused_backend(precision, impl, sets, flash, path):
    """Transformer Engine's flash and fused attention take 16-bit inputs only, and torch's SDPA on the local layers is
    planned flash-style in 16-bit only (as the rank's ``flash_style``): an fp32 GPU run and Megatron's unfused
    attention store the s^2 terms, and the plan counts them; the attention path is the one the rank would run."""
    from tests.unit.inline_recipes import inline_recipe

    r = inline_recipe("gpt_3d", f"training.precision={precision}", f"backend.megatron.transformer_impl={impl}",
                      *sets, check=False)
    assert Knobs.from_recipe(r).attention == path
    assert Knobs.from_recipe(r).flash is flash
