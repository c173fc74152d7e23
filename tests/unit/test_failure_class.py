"""Failure classes for in-job restarts (hpc_tools.job.failure_class): the classifier over recorded exit records and
causes, as a table over every class and its boundaries, and the no-progress guard. The rendered restart loop that
acts on them is tests/unit/test_restarts_classes.py."""

from __future__ import annotations

import pytest

from hpc_tools.job.failure_class import (
    INFRA,
    OOM,
    RESTART,
    STOP,
    TRANSIENT,
    USER,
    classify,
    exception_types,
    no_progress,
    oom_fix,
    signature,
)


def exc(types, message="boom", step=5, started=True, where="model.py:12 in forward", **extra) -> dict:
    """A rank's exit record as hpc_tools.runtime.rank writes it for a Python exception."""
    types = [types] if isinstance(types, str) else list(types)
    return {"code": 1, "error": f"{types[0]}: {message}", "time": 1.0, "types": types, "where": where, "step": step,
            "started": started, **extra}


OOM_TORCH = ["OutOfMemoryError", "RuntimeError"]
OS_ERROR = ["OSError"]
IN_JOB_SAME = [{"kind": "in-job", "signature": {"error": "OSError: [Errno 5] Input/output error", "step": 5}}]

CASES = [
    # (case, cause, exit record, previous restarts, kernel OOM note, class, decision)
    ("torch OOM", "exited", exc(OOM_TORCH, "CUDA out of memory. Tried to allocate 2.00 GiB"), [], False, OOM, STOP),
    ("host MemoryError", "exited", exc("MemoryError", ""), [], False, OOM, STOP),
    ("OOM text in a RuntimeError", "exited", exc("RuntimeError", "CUDA out of memory."), [], False, OOM, STOP),
    ("kernel OOM killer", "killed", None, [], True, OOM, STOP),
    ("OOM before step 1", "exited", exc(OOM_TORCH, "CUDA out of memory", step=0, started=False), [], False, OOM,
     STOP),
    ("killed rank", "killed", None, [], False, INFRA, RESTART),
    ("node failure", "node failure", None, [], False, INFRA, RESTART),
    ("hang", "hang", None, [], False, INFRA, RESTART),
    ("no exit record", "lost", None, [], False, INFRA, RESTART),
    ("NCCL DistBackendError", "exited", exc(["DistBackendError", "DistError", "RuntimeError"], "NCCL error"), [],
     False, INFRA, RESTART),
    ("gloo connection closed", "exited", exc("RuntimeError", "[../gloo/transport/tcp/pair.cc:534] Connection closed "
                                                             "by peer"), [], False, INFRA, RESTART),
    ("NCCL communicator aborted", "exited", exc("RuntimeError", "NCCL communicator was aborted on rank 0."), [],
     False, INFRA, RESTART),
    ("store timeout", "exited", exc(["DistStoreError", "DistError", "RuntimeError"], "Socket Timeout"), [], False,
     INFRA, RESTART),
    ("connection reset (an OSError)", "exited", exc(["ConnectionResetError", "ConnectionError", "OSError"]), [],
     False, INFRA, RESTART),
    ("a killed rank whose peer raised the comm error first is still infrastructure", "killed",
     exc("ValueError", "not a comm error"), [], False, INFRA, RESTART),
    ("exception at a step", "exited", exc("ValueError", "injected fault at step 5"), [], False, USER, STOP),
    ("exception before step 1", "exited", exc("KeyError", "'hidden'", step=0, started=False), [], False, USER, STOP),
    ("wrong data path", "exited", exc(["FileNotFoundError", "OSError"], "no such file: /data/x"), [], False, USER,
     STOP),
    ("RuntimeError without a comm or OOM sign", "exited", exc("RuntimeError", "shape mismatch"), [], False, USER,
     STOP),
    ("first I/O error", "exited", exc(OS_ERROR, "[Errno 5] Input/output error"), [], False, TRANSIENT, RESTART),
    ("I/O error again at the same step", "exited", exc(OS_ERROR, "[Errno 5] Input/output error"), IN_JOB_SAME, False,
     USER, STOP),
    ("I/O error again at another step", "exited", exc(OS_ERROR, "[Errno 5] Input/output error", step=6),
     IN_JOB_SAME, False, TRANSIENT, RESTART),
    ("I/O error after a requeue only (not an in-job start)", "exited", exc(OS_ERROR, "[Errno 5] Input/output error"),
     [{**IN_JOB_SAME[0], "kind": "requeue"}], False, TRANSIENT, RESTART),
    ("non-zero exit without a Python error", "exited", {"code": 3, "error": None, "time": 1.0}, [], False, TRANSIENT,
     RESTART),
    ("an older record: the type from the error line", "exited", {"code": 1, "error": "ValueError: x", "time": 1.0},
     [], False, USER, STOP),
    ("an older record of an OOM", "exited", {"code": 1, "error": "OutOfMemoryError: CUDA out of memory", "time": 1.0},
     [], False, OOM, STOP),
]


@pytest.mark.parametrize("case, cause, record, previous, kernel, cls, decision", CASES, ids=[c[0] for c in CASES])
def test_classify(case, cause, record, previous, kernel, cls, decision):
    verdict = classify(cause, record, previous, kernel_oom=kernel)
    assert (verdict.cls, verdict.decision) == (cls, decision), verdict
    assert verdict.why and "\n" not in verdict.why
    assert (verdict.fix is not None) == (cls == OOM)


def test_every_class_and_decision_is_in_the_table():
    assert {c[5] for c in CASES} == {USER, OOM, INFRA, TRANSIENT}
    assert {c[6] for c in CASES} == {STOP, RESTART}


def test_a_user_error_names_the_traceback_last_line_and_step():
    verdict = classify("exited", exc("ValueError", "injected fault at step 5\nmore"), [])
    assert verdict.why == "ValueError: injected fault at step 5 after step 5 (model.py:12 in forward)"


@pytest.mark.parametrize("knobs, expected", [
    ({"training.micro_batch_size": 4, "training.recompute_granularity": None},
     "try --set training.micro_batch_size=2 or --set training.recompute_granularity=full"),
    ({"training.micro_batch_size": 1, "training.recompute_granularity": "selective"},
     "try --set training.recompute_granularity=full;"),
    ({"training.micro_batch_size": 1, "training.recompute_granularity": "full"},
     "try more tensor/pipeline parallelism or more nodes;"),
    (None, "try a smaller --set training.micro_batch_size=N or --set training.recompute_granularity=full;"),
])
def test_the_oom_fix_names_the_memory_knobs(knobs, expected):
    fix = oom_fix(exc(OOM_TORCH, knobs=knobs) if knobs else None)
    assert fix.startswith(expected) and "plan RECIPE --search" in fix


def test_a_signature_is_the_error_line_and_step():
    assert signature(exc("ValueError", "x\ny", step=7)) == {"error": "ValueError: x", "step": 7}
    assert signature(None) is None and signature({"code": 3, "error": None}) is None
    assert exception_types({"code": 1, "error": "not a type name: x"}) == []


@pytest.mark.parametrize("froms, stops", [
    ([], None), ([10], None), ([10, 10], 10), ([8, 10], None), ([10, 10, 12], None), ([None, None], None),
    ([10, None], None), ([4, 10, 10], 10)])
def test_the_no_progress_guard(froms, stops):
    entries = [{"kind": "in-job", "from_iteration": f} for f in froms]
    assert no_progress(entries) == stops
    # requeues and refused restarts do not count as restarts
    assert no_progress([*entries, {"kind": "stop", "from_iteration": None}]) == stops


def test_the_rank_records_what_the_classifier_reads(tmp_path):
    """hpc_tools.runtime.rank's exit record of an exception: its class and bases, the innermost frame, the last
    completed step and whether this start completed one, the memory knobs; the watchdog keeps it in the heartbeat."""
    from types import SimpleNamespace

    from hpc_tools.runtime import heartbeat
    from hpc_tools.runtime.rank import exception_record
    from hpc_tools.runtime.watchdog import Watchdog

    dog = Watchdog(0, tmp_path, rank=3)
    ctx = SimpleNamespace(watchdog=dog, recipe=SimpleNamespace(
        training=SimpleNamespace(micro_batch_size=4, recompute_granularity="selective")))

    def inject():
        raise FileNotFoundError("no such file: /data/x")

    for started in (False, True):
        if started:
            dog.beat(7)
        try:
            inject()
        except FileNotFoundError as error:
            record = exception_record(error, ctx)
        assert record["types"] == ["FileNotFoundError", "OSError"]
        assert record["where"].startswith("test_failure_class.py:") and record["where"].endswith(" in inject")
        assert (record["step"], record["started"]) == ((7, True) if started else (0, False))
        assert record["knobs"] == {"training.micro_batch_size": 4, "training.recompute_granularity": "selective"}
    dog.stop(exit_code=1, error="FileNotFoundError: no such file: /data/x", **record)
    kept = heartbeat.read_all(tmp_path)[3].exit
    assert kept["types"] == record["types"] and kept["step"] == 7 and kept["code"] == 1
    assert classify("exited", kept, []).cls == USER
