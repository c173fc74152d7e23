"""hpc_tools.runstate: the Slurm-state map and terminal set, the sacct parser and cache, merging Slurm's view into
the manifest, the classification with its reason, and the `logs -f` stop condition."""

from __future__ import annotations

import io
import json
import threading

import pytest

from hpc_tools import runstate
from hpc_tools.cli.logs import follow
from hpc_tools.registry import RunFolder
from hpc_tools.runstate import (
    LIVE_STATES,
    LIVE_STATUSES,
    RUN_STATES,
    RUN_TO_STATUS,
    SPECIFICITY,
    STATUSES,
    TERMINAL_STATES,
    SacctReader,
    SlurmJob,
    classify,
    ended,
    is_terminal,
    parse_sacct,
    refresh,
    refresh_all,
    run_state,
)

# Every state sacct can print in its State column: Slurm's base job states, the flag states it shows instead of
# them, and "CANCELLED by <uid>" (with -P, as the reader calls it, sacct never cuts a word to fit a column).
SLURM_FINISHED = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
                  "OUT_OF_MEMORY")  # Slurm's IS_JOB_FINISHED base states
SLURM_LIVE = ("PENDING", "RUNNING", "SUSPENDED", "COMPLETING", "CONFIGURING", "REQUEUED", "REQUEUE_FED",
              "REQUEUE_HOLD", "RESIZING", "STAGE_OUT", "SIGNALING", "STOPPED", "RESV_DEL_HOLD", "POWER_UP_NODE",
              "UPDATE_DB")
SLURM_ENDING_FLAGS = ("SPECIAL_EXIT", "REVOKED", "LAUNCH_FAILED", "RECONFIG_FAIL")
SUFFIXED = ("CANCELLED by 0", "CANCELLED by 123")


@pytest.mark.parametrize("state", SLURM_FINISHED + SLURM_LIVE + SLURM_ENDING_FLAGS + SUFFIXED)
def test_every_state_sacct_prints_maps_to_a_run_state(state):
    assert run_state(state) in RUN_STATES


def test_terminal_set_holds_every_finished_slurm_state_and_nothing_live():
    assert all(is_terminal(s) for s in SLURM_FINISHED + SLURM_ENDING_FLAGS)
    assert not any(is_terminal(s) for s in SLURM_LIVE)
    assert is_terminal("CANCELLED by 123") and run_state("CANCELLED by 123") == "CANCELLED"
    assert run_state("DEADLINE") == "TIMEOUT" and run_state("BOOT_FAIL") == "NODE_FAIL"
    assert not is_terminal(None) and not is_terminal("") and run_state("NO_SUCH_STATE") is None


def test_vocabularies_are_one_closed_set():
    assert set(LIVE_STATES).isdisjoint(TERMINAL_STATES) and set(RUN_STATES) == set(RUN_TO_STATUS)
    assert set(RUN_TO_STATUS.values()) == set(STATUSES)
    assert set(SPECIFICITY) | set(LIVE_STATUSES) == set(STATUSES)
    assert {RUN_TO_STATUS[s] for s in TERMINAL_STATES} == set(SPECIFICITY)
    assert all(is_terminal(s) for s in TERMINAL_STATES) and not any(is_terminal(s) for s in LIVE_STATES)


def test_parse_sacct_tolerates_junk_and_short_lines():
    jobs = parse_sacct("\n  \nnot a sacct line\n7|RUNNING|0:0\n8|CANCELLED by 1000|0:15|00:00:03|n[1-2]\n|x|y\n")
    assert set(jobs) == {"7", "8"}
    assert jobs["7"] == SlurmJob("7", "RUNNING", "0:0", "", "")
    assert jobs["8"].slurm_state == "CANCELLED" and jobs["8"].terminal and jobs["8"].nodelist == "n[1-2]"


class FakeSacct:
    """Stands in for the sacct command: records each call's job ids, answers from ``states``."""

    def __init__(self, states: dict[str, str] | None = None, fail: bool = False):
        self.states = states or {}
        self.fail = fail
        self.calls: list[list[str]] = []

    def __call__(self, job_ids: list[str]) -> str | None:
        self.calls.append(list(job_ids))
        if self.fail:
            return None
        return "".join(f"{j}|{self.states[j]}|0:0|00:00:05|n1\n" for j in job_ids if j in self.states)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_one_sacct_call_for_many_jobs_then_cached():
    sacct, clock = FakeSacct({str(j): "RUNNING" for j in range(1, 11)}), Clock()
    reader = SacctReader(max_age_s=2.0, query=sacct, clock=clock)
    jobs = reader.jobs([str(j) for j in range(1, 11)] + ["99"])
    assert len(sacct.calls) == 1 and sorted(sacct.calls[0], key=int) == [str(j) for j in range(1, 11)] + ["99"]
    assert set(jobs) == {str(j) for j in range(1, 11)}  # 99 is not in accounting (yet)
    clock.now += 1.0
    assert reader.job("3").state == "RUNNING" and reader.jobs(["1", "99"]) == {"1": jobs["1"]}
    assert len(sacct.calls) == 1  # fresh answers, including "sacct does not know 99", are reused
    clock.now += 2.5
    sacct.states["3"] = "TIMEOUT"
    assert reader.job("3").state == "TIMEOUT" and sacct.calls[-1] == ["3"] and reader.calls == 2


def test_a_failing_sacct_keeps_what_was_known():
    sacct, clock = FakeSacct({"5": "RUNNING"}), Clock()
    reader = SacctReader(max_age_s=1.0, query=sacct, clock=clock)
    assert reader.job("5").state == "RUNNING"
    sacct.fail = True
    clock.now += 5
    assert reader.job("5").state == "RUNNING" and reader.job("6") is None and len(sacct.calls) == 3


def test_missing_sacct_is_no_answer(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert runstate.run_sacct(["1"]) is None
    assert SacctReader().jobs(["1", "2"]) == {}


def slurm_run(tmp_path, name: str = "r", **manifest) -> RunFolder:
    fields = {"executor": "slurm", "job_id": "5", "state": "RUNNING", **manifest}
    return RunFolder.create(tmp_path, name, "x: 1\n", "", fields)


@pytest.mark.parametrize("slurm,state", [("DEADLINE", "TIMEOUT"), ("BOOT_FAIL", "NODE_FAIL"), ("TIMEOUT", "TIMEOUT"),
                                         ("CANCELLED by 0", "CANCELLED"), ("PREEMPTED", "PREEMPTED"),
                                         ("COMPLETED", "RUNNING"), ("RUNNING", "RUNNING")])
def test_refresh_records_slurms_state(tmp_path, slurm, state):
    run = slurm_run(tmp_path)
    reader = SacctReader(query=FakeSacct({"5": slurm}))
    manifest = refresh(run, reader=reader)
    assert manifest["state"] == state and manifest["slurm_state"] == slurm.split()[0]
    assert manifest["events"][-1]["event"] == f"slurm {slurm.split()[0]}"
    assert ended(manifest) == is_terminal(slurm)
    assert refresh(run, reader=reader)["events"] == manifest["events"]  # no new event for the same state


def test_slurms_verdict_replaces_the_ranks_preempted_report_but_completed_does_not(tmp_path):
    cancelled = slurm_run(tmp_path, "a", state="PREEMPTED")
    assert refresh(cancelled, reader=SacctReader(query=FakeSacct({"5": "CANCELLED by 0"})))["state"] == "CANCELLED"
    stopped = slurm_run(tmp_path, "b", state="PREEMPTED")  # USR2 with requeue off: the job then exits 0
    assert refresh(stopped, reader=SacctReader(query=FakeSacct({"5": "COMPLETED"})))["state"] == "PREEMPTED"


def test_refresh_all_asks_sacct_once(tmp_path, monkeypatch):
    sacct = FakeSacct({str(j): "COMPLETED" for j in range(20)})
    monkeypatch.setattr(runstate, "READER", SacctReader(query=sacct))
    runs = [slurm_run(tmp_path, f"r{j}", job_id=str(j)) for j in range(20)]
    runs.append(RunFolder.create(tmp_path, "local", "x: 1\n", "", {"executor": "local", "state": "COMPLETED"}))
    results = refresh_all(runs)
    assert len(sacct.calls) == 1 and len(sacct.calls[0]) == 20
    assert all(m["slurm_state"] == "COMPLETED" and job.state == "COMPLETED" for m, job in results[:20])
    assert results[20][1] is None and "slurm_state" not in results[20][0]


def local_run(tmp_path, state: str, name: str = "l", **manifest) -> RunFolder:
    return RunFolder.create(tmp_path, name, "x: 1\n", "", {"executor": "local", "state": state, **manifest})


def test_classification_and_reason(tmp_path):
    stopped = local_run(tmp_path, "PREEMPTED", "a", last_step=4)
    assert classify(stopped) == runstate.Verdict("preempted", "stopped by a signal after step 4, not requeued")
    cancelled = local_run(tmp_path, "PREEMPTED", "b", cancel_requested="2026-01-01T00:00:00+00:00")
    assert classify(cancelled).status == "cancelled" and "cancel requested at 2026-01-01" in classify(cancelled).reason
    timed_out = local_run(tmp_path, "PREEMPTED", "c")
    (timed_out.logs_dir / "rank00000.out").write_text(
        "x\nslurmstepd: error: *** JOB 9 ON n1 CANCELLED AT 2026-01-01T00:01:00 DUE TO TIME LIMIT ***\ny\n")
    verdict = classify(timed_out)
    assert verdict.status == "timeout" and verdict.reason.startswith("rank00000.out: slurmstepd: error: *** JOB 9")
    failed = local_run(tmp_path, "FAILED", "d", error="RuntimeError: boom")
    assert classify(failed) == runstate.Verdict("failed", "RuntimeError: boom")
    hung = local_run(tmp_path, "FAILED", "e", exit_code=86)
    assert classify(hung).status == "hang"
    on_slurm = slurm_run(tmp_path, "f", state="PREEMPTED")
    verdict = classify(on_slurm, SlurmJob("5", "CANCELLED by 0", "0:15", "00:00:31", "n1"))
    assert verdict == runstate.Verdict("cancelled", "Slurm CANCELLED by 0, exit code 0:15 after 00:00:31")
    assert "\n" not in classify(local_run(tmp_path, "FAILED", "g", error="x\n" * 300)).reason
    assert len(classify(local_run(tmp_path, "FAILED", "h", error="y" * 999)).reason) <= runstate.REASON_MAX


def run_follow(run: RunFolder, out: io.BytesIO) -> threading.Thread:
    # rank None: the whole log (a shared batch log unfiltered), what `logs -f` prints without --rank
    thread = threading.Thread(target=follow, args=(run, None, out), kwargs={"poll_s": 0.02}, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("slurm", SLURM_FINISHED + SLURM_ENDING_FLAGS + ("CANCELLED by 123",))
def test_logs_follow_stops_on_every_terminal_slurm_state(tmp_path, monkeypatch, slurm):
    sacct = FakeSacct({"5": "RUNNING"})
    monkeypatch.setattr(runstate, "READER", SacctReader(max_age_s=0.0, query=sacct))
    run = slurm_run(tmp_path, batch_log=str(tmp_path / "batch.out"))
    (tmp_path / "batch.out").write_text("rendezvous ok\n")
    out = io.BytesIO()
    thread = run_follow(run, out)
    thread.join(0.3)
    assert thread.is_alive(), "follow returned while Slurm still said RUNNING"
    with open(tmp_path / "batch.out", "a") as f:
        f.write("last line\n")
    sacct.states["5"] = slurm
    thread.join(10)
    assert not thread.is_alive(), f"logs -f did not end on {slurm}"
    assert out.getvalue() == b"rendezvous ok\nlast line\n"


@pytest.mark.parametrize("state", TERMINAL_STATES)
def test_logs_follow_stops_when_the_run_records_its_end(tmp_path, state):
    run = local_run(tmp_path, state)
    (run.logs_dir / "rank00000.out").write_text("done\n")
    out = io.BytesIO()
    run_follow(run, out).join(10)
    assert out.getvalue() == b"done\n"


def test_status_and_list_show_the_classification(tmp_path, cli):
    local_run(tmp_path, "FAILED", "r1", error="RuntimeError: boom", created="2026-01-01T00:00:00+00:00")
    out = cli("status", "r1", "--json", "--runs-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["state"] == "FAILED" and data["status"] == "failed" and data["reason"] == "RuntimeError: boom"
    text = cli("status", "--runs-dir", str(tmp_path)).stdout
    assert "status   failed: RuntimeError: boom" in text
    rows = json.loads(cli("list", "--json", "--runs-dir", str(tmp_path)).stdout)
    assert [(r["run_id"], r["state"], r["status"]) for r in rows] == [("r1", "FAILED", "failed")]
