"""``trainer.import_deepspeed``: DeepSpeed imported without mlflow behind its autotuner, with ``import mlflow`` left
as it was (a fresh interpreter: the import happens once per process), and DeepSpeed's training API all there."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.util import find_spec

import pytest

from tests.helpers import REPO

CHILD = r'''
import json, sys
from hpc_tools.train.deepspeed.trainer import import_deepspeed
import_deepspeed()
import deepspeed
from deepspeed.autotuning import autotuner
out = {"mlflow_listed": "mlflow" in sys.modules, "autotuner_sees_mlflow": autotuner.has_mlflow,
       "api": all(callable(getattr(deepspeed, n, None)) for n in ("initialize", "init_distributed"))}
try:
    import mlflow  # noqa: F401
    out["mlflow_after"] = True
except ImportError:
    out["mlflow_after"] = False
print(json.dumps(out))
'''


@pytest.mark.skipif(find_spec("torch") is None or find_spec("deepspeed") is None, reason="needs torch and DeepSpeed")
def test_deepspeed_imports_without_mlflow_and_leaves_it_importable():
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", CHILD], capture_output=True, text=True, cwd=REPO,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["mlflow_listed"] is False and seen["autotuner_sees_mlflow"] is False
    assert seen["api"] is True
    assert seen["mlflow_after"] is (find_spec("mlflow") is not None)  # the recipe's tracking.mlflow still imports it


def test_absent_hides_only_what_was_not_imported_and_leaves_nothing_behind():
    import importlib
    import json as already

    from hpc_tools.train.imports import absent

    name = "tabnanny"  # a standard-library module nothing here imports
    assert name not in sys.modules
    with absent(name, "json"):
        with pytest.raises(ImportError):
            importlib.import_module(name)
        assert sys.modules["json"] is already  # imported before: untouched
    assert name not in sys.modules and sys.modules["json"] is already
    assert importlib.import_module(name).__name__ == name  # importable again afterwards
