"""The planner's activation bytes equal what autograd saves in the real Megatron-core model, for random configurations.

120 configurations (seeded) of the space the Megatron job supports -- GPT and LLaMA shapes, LayerNorm/RMSNorm,
GELU/SwiGLU, learned/RoPE positions, biases, grouped-query attention, hidden and attention dropout, bf16/fp32,
no/selective/full (uniform, block) recomputation, TP 1 and 2 with and without sequence parallelism, and the chunk's
pipeline role (embedding on the first stage, final norm + output layer + loss on the last, both, or neither) -- are
built as the job builds them and run forward once in ONE launch of two gloo ranks (``hpc_tools.testing.activations``:
TP2 cases on both ranks together, TP1 cases shared out between them). The bytes autograd keeps for backward
(saved-tensor hooks, each storage once) must equal the planner's per layer and per chunk, exactly.
"""

from __future__ import annotations

import json
import sys

import pytest

N_CASES, SEED = 120, 15


@pytest.fixture(scope="module")
def comparison(tmp_path_factory) -> list[dict]:
    import hpc_tools.planner.memory as memory
    from hpc_tools.testing.activations import compare, predict_case, sample_cases
    from hpc_tools.testing.spawn import spawn_ranks

    tmp = tmp_path_factory.mktemp("activations")
    cases = sample_cases(N_CASES, SEED)
    (tmp / "cases.json").write_text(json.dumps([c.as_dict() for c in cases]))
    ranks = spawn_ranks([sys.executable, "-m", "hpc_tools.testing.activations", tmp / "cases.json", tmp / "measured"],
                        2, env={"HF_HUB_OFFLINE": "1"}, timeout_s=600)
    assert all(r.ok for r in ranks), ranks[0].log[-3000:]
    measured = json.loads((tmp / "measured.json").read_text())
    assert len(measured) == N_CASES and all(m is not None for m in measured)
    return [{**compare(c, m, predict_case(c, memory)), "overrides": c.overrides, "tensor": c.tensor}
            for c, m in zip(cases, measured)]


@pytest.mark.megatron
def test_the_sample_covers_the_supported_space(comparison):
    labels = " ".join(row["case"] for row in comparison)
    for shape in ("rope", "learned_absolute", "swiglu", "gelu", "RMSNorm", "LayerNorm", "selective", "full",
                  "uniform", "block", "bf16", "fp32", "hidden_dropout=0.1", "attention_dropout=0.1", " SP ", "TP1",
                  "TP2", "first", "last", "middle", "both"):
        assert shape in labels, shape
    gqa = [row for row in comparison if _value(row, "num_query_groups") < _value(row, "num_attention_heads")]
    assert gqa and len(gqa) < len(comparison)


def _value(row: dict, field: str) -> int:
    return int(next(o.split("=")[1] for o in row["overrides"] if o.startswith(f"model.{field}=")))


@pytest.mark.megatron
def test_layer_activations_are_exact(comparison):
    rows = [row for row in comparison if row["measured_layer"] is not None]
    assert len(rows) > N_CASES // 2
    wrong = [f"{row['case']}: measured {row['measured_layer']} predicted {row['predicted_layer']}"
             for row in rows if row["predicted_layer"] != row["measured_layer"]]
    assert not wrong, "\n".join(wrong[:10])


@pytest.mark.megatron
def test_chunk_activations_are_exact(comparison):
    """Per chunk and microbatch: layers, embedding, head and loss, full-recompute checkpoints."""
    wrong = [f"{row['case']}: measured {row['measured_total']} predicted {row['predicted_total']} "
             f"(edge {row['measured_edge']} vs {row['predicted_edge']})"
             for row in comparison if row["predicted_total"] != row["measured_total"]]
    assert not wrong, "\n".join(wrong[:10])
