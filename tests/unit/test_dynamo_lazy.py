"""``train.dynamo_lazy``: a rank's optimizer (AdamW and SGD steps, zero_grad, state_dict, load_state_dict) and the
wrappers made after ``install`` (DTensor's, an optimizer class defined later) run without importing TorchDynamo, to
the same values as torch's own path; once anything imports TorchDynamo every call goes torch's way again (a fresh
interpreter each: the import happens once per process)."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.util import find_spec

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.skipif(find_spec("torch") is None, reason="needs torch")

TRAIN = r'''
import json, sys, torch
if sys.argv[1] == "lazy":
    from hpc_tools.train import dynamo_lazy
    assert dynamo_lazy.install() and dynamo_lazy.install()  # idempotent
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
opts = [torch.optim.AdamW(model[0].parameters(), lr=0.05), torch.optim.SGD(model[2].parameters(), lr=0.1,
                                                                            momentum=0.9)]
grad_in_step = []
for step in range(3):
    for opt in opts:
        opt.zero_grad()
    model(torch.randn(4, 8)).pow(2).mean().backward()
    for opt in opts:
        opt.step()
    if step == 1:  # a checkpoint round trip between steps
        for opt in opts:
            opt.load_state_dict(opt.state_dict())
from torch.optim.optimizer import _use_grad_for_differentiable


class Probe(torch.optim.SGD):  # an optimizer defined after install, decorated as torch's own are
    @_use_grad_for_differentiable
    def step(self, closure=None):
        grad_in_step.append(torch.is_grad_enabled())
        return super().step(closure)


probe = Probe(model[2].parameters(), lr=0.1)
probe.step()
out = {"dynamo": "torch._dynamo" in sys.modules, "grad_after": torch.is_grad_enabled(), "grad_in": grad_in_step,
       "params": [p.detach().flatten().tolist() for p in model.parameters()]}
if sys.argv[1] == "lazy":
    from torch.distributed.tensor import DTensor  # imported after install: its __init__ wrapper made then
    fn = DTensor.__init__.__closure__[DTensor.__init__.__code__.co_freevars.index("fn")].cell_contents
    out["dtensor_deferred"] = type(getattr(fn, "__dynamo_disable", None)).__name__ == "_LazyDisable"
    out["dynamo_after_dtensor"] = "torch._dynamo" in sys.modules
print(json.dumps(out))
'''

AFTER_IMPORT = r'''
import json, sys, torch
from hpc_tools.train import dynamo_lazy
dynamo_lazy.install()
import torch._dynamo
breaks = []
real_break = torch._dynamo.graph_break
torch._dynamo.graph_break = lambda *a, **k: breaks.append(1)
p = torch.nn.Parameter(torch.ones(2))
opt = torch.optim.AdamW([p], lr=0.1)
p.grad = torch.ones(2)
opt.step()
opt.zero_grad()
inner = torch.optim.Optimizer.zero_grad
fn = inner.__closure__[inner.__code__.co_freevars.index("fn")].cell_contents
print(json.dumps({"graph_breaks": len(breaks), "cache": type(getattr(fn, "__dynamo_disable")).__name__,
                  "grad": p.grad is None}))
'''


def _child(code: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code, *args], capture_output=True, text=True,
                         cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_optimizer_runs_without_dynamo_to_torchs_values():
    lazy, plain = _child(TRAIN, "lazy"), _child(TRAIN, "plain")
    assert plain["dynamo"] is True  # torch's own path imports it: what install avoids
    assert lazy["dynamo"] is False and lazy["dtensor_deferred"] is True and lazy["dynamo_after_dtensor"] is False
    assert lazy["params"] == plain["params"]  # bit for bit: the same function ran
    assert lazy["grad_in"] == plain["grad_in"] == [False]  # no autograd inside step, as torch's wrapper sets it
    assert lazy["grad_after"] is plain["grad_after"] is True  # and restored after


def test_once_dynamo_is_imported_calls_go_torchs_way():
    seen = _child(AFTER_IMPORT)
    assert seen["graph_breaks"] == 2  # step's two graph_break() calls, as _use_grad_for_differentiable makes them
    assert seen["cache"] != "_LazyDisable"  # zero_grad now runs under torch._dynamo.disable
    assert seen["grad"] is True
