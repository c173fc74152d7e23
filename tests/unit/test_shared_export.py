"""One export per checkpoint (issue 47): eval, quantize and serve read the run's one export of a checkpoint,
``<run>/exports/iter_NNNNNNN`` (``hpc_tools.hf.export.shared_export``), written once and reused while its record
names that checkpoint. The export itself (``export_run``) is the real one in tests/integration/test_serve.py and
test_evaluate.py; here it is a stand-in that counts its calls."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hpc_tools.checkpoints.dirs import CheckpointDirs
from hpc_tools.errors import UserError
from hpc_tools.evaluate import target
from hpc_tools.hf import export
from hpc_tools.testing.synthetic import synthetic_run


@pytest.fixture
def run_and_calls(tmp_path, monkeypatch):
    run = synthetic_run(tmp_path, [], 0.1 + np.zeros((1, 4)))
    dirs = CheckpointDirs(run.path / "checkpoints")
    for step in (2, 4):
        (dirs.begin(step) / "model.pt").write_bytes(b"x")
        dirs.commit(step)
    calls = []

    def fake_export(run_dir, out, step=None, overwrite=False):
        calls.append((str(out), step))
        out.mkdir(parents=True, exist_ok=True)
        ckpt = dirs.final_path(step)
        (out / export.EXPORT_META).write_text(json.dumps({"checkpoint": str(ckpt), "step": step}))
        return {}

    monkeypatch.setattr(export, "export_run", fake_export)
    return run, dirs, calls


def test_one_export_per_checkpoint_shared_by_eval_and_serve(run_and_calls):
    run, dirs, calls = run_and_calls
    ckpt = dirs.final_path(4)
    first = export.shared_export(run, ckpt)
    assert first == run.path / "exports" / "iter_0000004" and calls == [(str(first), 4)]
    # eval's model of that iteration is the same folder, and asks for no second export
    model = target.Model(target.export_folder(run, 4), 4, 4, None, ckpt)
    assert target.ensure_exported(model, run) == first and len(calls) == 1
    assert export.shared_export(run, ckpt) == first and len(calls) == 1
    # another checkpoint, its own folder
    assert export.shared_export(run, dirs.final_path(2)) == run.path / "exports" / "iter_0000002" and len(calls) == 2


def test_an_export_of_another_checkpoint_at_that_step_is_written_again(run_and_calls):
    run, dirs, calls = run_and_calls
    folder = export.export_dir(run, 4)
    folder.mkdir(parents=True)
    (folder / export.EXPORT_META).write_text(json.dumps({"checkpoint": "/elsewhere/iter_0000004"}))
    assert export.shared_export(run, dirs.final_path(4)) == folder and len(calls) == 1


def test_a_folder_that_is_not_a_checkpoint_is_one_line(run_and_calls, tmp_path):
    run, _, calls = run_and_calls
    with pytest.raises(UserError, match="is not a checkpoint folder") as err:
        export.shared_export(run, tmp_path / "nothing")
    assert "\n" not in str(err.value) and not calls
