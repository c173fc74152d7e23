"""``cpu_compat.import_megatron``: megatron-core imported on a CPU-only torch without TorchDynamo/Inductor behind its
fusion decorators, without wandb behind its inference context and without torch.utils.tensorboard behind its timers,
with torch.compile, ``import wandb`` and ``import torch.utils.tensorboard`` left as they were (a fresh interpreter:
the import happens once per process)."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.util import find_spec

import pytest

from tests.helpers import REPO

CHILD = r'''
import json, sys, torch
real = torch.compile
from hpc_tools.train.megatron import cpu_compat
cpu_compat.import_megatron()
from megatron.core import jit
from megatron.core.fusions import fused_bias_geglu
out = {"dynamo": "torch._dynamo" in sys.modules, "compile_restored": torch.compile is real,
       "fuser_eager": jit.jit_fuser(len) is len, "geglu_plain": type(fused_bias_geglu.geglu_back).__name__,
       "wandb_listed": "wandb" in sys.modules, "tensorboard_listed": "torch.utils.tensorboard" in sys.modules}
from megatron.core import timers
out["timers_writer"] = timers.SummaryWriter is None
import torch.utils.tensorboard
out["tensorboard_after"] = callable(torch.utils.tensorboard.SummaryWriter)
try:
    import wandb  # noqa: F401
    out["wandb_after"] = True
except ImportError:
    out["wandb_after"] = False
print(json.dumps(out))
'''


@pytest.mark.skipif(find_spec("torch") is None or find_spec("megatron") is None, reason="needs torch and megatron-core")
def test_megatron_imports_on_cpu_without_dynamo_or_wandb_and_leaves_both_usable():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA torch keeps megatron-core's own import (the fusions compile there)")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", CHILD], capture_output=True, text=True, cwd=REPO,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["dynamo"] is False and seen["compile_restored"] is True and seen["fuser_eager"] is True
    assert seen["geglu_plain"] == "function"  # a plain function, not torch.compile's wrapper
    assert seen["wandb_listed"] is False  # megatron-core read it as absent; nothing left behind in sys.modules
    assert seen["wandb_after"] is (find_spec("wandb") is not None)  # the recipe's tracking still imports it
    assert seen["tensorboard_listed"] is False and seen["timers_writer"] is True
    assert seen["tensorboard_after"] is True
