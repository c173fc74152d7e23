"""The router figures are computed on the device and read with the loss: one all-reduce per step and no host read in
``RouterLoad.step_tensor`` (the previous ``step`` made two world all-reduces and four host reads before the
optimizer step), and the figures are those of the previous computation, value for value.

Runs in a subprocess on a 1-rank gloo world (the reduction is the identity there; the multi-rank figures are checked
by tests/integration/test_megatron_moe.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.megatron

CODE = textwrap.dedent('''
    import json, math, os, sys
    from types import SimpleNamespace
    import torch
    import torch.distributed as dist
    from megatron.core.transformer.moe import moe_utils
    from hpc_tools.train.megatron.router_load import RouterLoad

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29000 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)

    def previous(counts, values, tp, data_size, moe_layers, microbatches, has_aux):
        """RouterLoad.step before the change (after its all-reduces): the figures it returned."""
        counts = counts.clone() / tp
        used = counts[counts.sum(1) > 0]
        imbalance = float((used.max(1).values / used.mean(1)).max()) if len(used) else None
        aux = float(values.sum()) / (data_size * moe_layers * microbatches) if has_aux else None
        return {"moe_tokens_per_expert": [int(round(x)) for x in counts.sum(0).tolist()],
                "moe_load_imbalance": imbalance, "moe_aux_loss": aux}

    reads, collectives = [], []
    for name in ("item", "__float__", "__int__", "__bool__", "tolist", "cpu", "numpy", "__index__"):
        original = getattr(torch.Tensor, name)
        def read(self, *a, _name=name, _original=original, **k):
            reads.append(_name)
            return _original(self, *a, **k)
        setattr(torch.Tensor, name, read)
    for name in ("all_reduce", "broadcast", "all_gather", "barrier", "reduce"):
        original = getattr(dist, name)
        def coll(*a, _name=name, _original=original, **k):
            collectives.append(_name)
            return _original(*a, **k)
        setattr(dist, name, coll)

    out = []
    torch.manual_seed(0)
    cases = [("aux_loss", [1, 0, 1], 1, 7), ("seq_aux_loss", [1, 1, 1], 2, 3), ("none", [1, 0, 1], 1, 2),
             ("aux_loss", [1, 0, 1], 1, 0)]  # the last: no MoE layer routed a token (a stage without them)
    for balancing, freq, tp, scale in cases:
        config = SimpleNamespace(num_moe_experts=4, num_layers=3, moe_layer_freq=freq, sequence_parallel=tp == 1,
                                 tensor_model_parallel_size=tp, moe_router_load_balancing_type=balancing)
        router = RouterLoad([], config, data_size=2, device=torch.device("cpu"))
        counts = torch.randint(0, 50, (3, 4)).double() * scale
        counts[1] = 0  # a dense layer
        router.counts.copy_(counts)
        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        tracker.clear()
        values = torch.rand(3, dtype=torch.float32) * 3
        if router.aux_name:
            tracker[router.aux_name] = {"values": values.clone()}
        want = previous(counts, values.double(), router.tp_duplicates, 2, router.moe_layers, 5, bool(router.aux_name))
        reads.clear(); collectives.clear()
        tensor = router.step_tensor(5)
        in_step = (list(reads), list(collectives))
        got = router.figures(tensor.tolist())
        zeroed = bool(router.counts.eq(0).all())
        if router.aux_name:
            zeroed = zeroed and bool(tracker[router.aux_name]["values"].eq(0).all())
        out.append({"want": want, "got": got, "reads": in_step[0], "collectives": in_step[1], "zeroed": zeroed})
    dist.destroy_process_group()
    print(json.dumps(out))
''')


@pytest.fixture(scope="module")
def cases() -> list[dict]:
    proc = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_one_all_reduce_and_no_host_read_per_step(cases):
    for case in cases:
        assert case["reads"] == [] and case["collectives"] == ["all_reduce"], case


def test_figures_are_the_previous_ones_value_for_value(cases):
    for case in cases:
        assert case["got"] == case["want"], case
        assert case["zeroed"], case
    assert cases[2]["got"]["moe_aux_loss"] is None  # load_balancing_type: none
    assert cases[3]["got"]["moe_load_imbalance"] is None and cases[3]["got"]["moe_tokens_per_expert"] == [0] * 4
    assert all(c["got"]["moe_load_imbalance"] >= 1.0 for c in cases[:3])
