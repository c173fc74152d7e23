"""``imports.import_transformers``: transformers' model code imported without torchao and scipy (a fresh interpreter:
the import happens once per process), the causal LMs the HF backends build still built and run, and both packages
importable afterwards."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.util import find_spec

import pytest

from tests.helpers import REPO

CHILD = r'''
import json, sys, torch
from hpc_tools.train.imports import import_transformers
import_transformers()
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig
out = {"listed": [m for m in ("torchao", "scipy") if m in sys.modules]}
losses = []
for cfg in (LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=64),
            GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64, n_positions=16)):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    ids = torch.randint(0, 64, (2, 8))
    losses.append(model(ids, labels=ids).loss.item())
out["losses"] = losses
from accelerate import init_empty_weights
with init_empty_weights(include_buffers=False):
    out["meta"] = next(AutoModelForCausalLM.from_config(cfg).parameters()).device.type
import_transformers()  # a no-op now
after = {}
for name in ("torchao", "scipy"):
    try:
        __import__(name)
        after[name] = True
    except ImportError:
        after[name] = False
out["after"] = after
print(json.dumps(out))
'''


@pytest.mark.skipif(find_spec("torch") is None or find_spec("transformers") is None or find_spec("accelerate") is None,
                    reason="needs torch, transformers and accelerate")
def test_transformers_model_code_without_torchao_or_scipy():
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", CHILD], capture_output=True, text=True, cwd=REPO,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["listed"] == []  # read as absent while transformers imported, nothing left in sys.modules
    assert len(seen["losses"]) == 2 and all(3.0 < loss < 6.0 for loss in seen["losses"])  # ~ln(64) untrained
    assert seen["meta"] == "meta"
    assert seen["after"] == {name: find_spec(name) is not None for name in ("torchao", "scipy")}
