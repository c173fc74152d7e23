"""The evidence of an ended step: its culprit (srun's reports in the batch log, the heartbeats of this start, the
hang watchdog's verdict, the kernel's OOM note) and the class of its failure with the decision it implies
(``judge``, from ``hpc_tools.job.failure_class``)."""

from __future__ import annotations

from hpc_tools.job.failure_class import KERNEL_OOM, RESTART, STOP, classify, no_progress, signature
from hpc_tools.job.restarts.facts import RESTART_LINE
from hpc_tools.registry import RunFolder
from hpc_tools.runstate import HANG_EXIT_CODE
from hpc_tools.runtime import heartbeat


def culprit(run: RunFolder, exit_code: int, start: int, failures: list | None = None) -> dict:
    """The ended step's culprit: {cause, rank, node, reason} from the launcher's ``failures`` (the local executor's
    exit codes) or srun's reports, the heartbeats and a hang verdict."""
    from hpc_tools.job.epilogue import decide, from_heartbeats, read_srun_reports

    manifest = run.manifest()
    beats = heartbeat.read_all(run.path, start)
    failures = failures or read_srun_reports(run) or from_heartbeats(beats, manifest.get("world_size"))
    silent = sorted(r for r, b in beats.items() if not b.exit)
    if failures and failures[0].signal is None and not failures[0].node_failure and silent and \
            all(r in beats and beats[r].exit for r in failures[0].ranks):
        # the ranks srun names first exited with an error (their peer's connection closed) while another rank left
        # no exit record: that one died first, with its node or by a signal (a peer's death makes the others raise)
        from hpc_tools.job.epilogue import TaskFailure

        # The first to go stopped beating first (a peer srun killed after it beat on): its node, and its ranks there.
        node = beats[min(silent, key=lambda r: (beats[r].time, r))].node
        ranks = [r for r in silent if beats[r].node == node]
        failures = [TaskFailure(ranks=ranks, node=node, text="ended without an exit record")]
    ending = decide(exit_code, failures, beats, {**manifest, "state": "RUNNING"})
    hang = manifest.get("state") == "HANG" or exit_code == HANG_EXIT_CODE
    first = failures[0] if failures else None
    if hang:
        cause = "hang"
    elif ending.state == "NODE_FAIL":
        cause = "node failure"
    elif first is not None and first.signal is not None:
        cause = "killed"
    elif first is not None and first.code is not None:
        cause = "exited"
    elif first is not None and first.text == "ended without an exit record":
        cause = "lost"
    else:
        cause = "failed"
    ranks = (manifest.get("failed_ranks") if hang else None) or ending.failed_ranks
    nodes = (manifest.get("failed_nodes") if hang else None) or ending.failed_nodes
    reason = (manifest.get("reason") if hang else None) or ending.reason
    return {"cause": cause, "rank": ranks[0] if ranks else None, "node": nodes[0] if nodes else None,
            "reason": reason}


def kernel_oom(run: RunFolder) -> bool:
    """Whether the kernel's OOM killer ended a task of the latest rank step (slurmstepd's note in the batch log,
    after the last restart line)."""
    from hpc_tools.job.epilogue import LOG_TAIL_BYTES, log_files, log_tail, this_life

    for path in log_files(run):
        text = this_life(log_tail(path, LOG_TAIL_BYTES) or "")
        if KERNEL_OOM.search(text.rsplit(RESTART_LINE, 1)[-1]):
            return True
    return False


def judge(run: RunFolder, found: dict, start: int, manifest: dict) -> dict:
    """The class of the ended step's failure and the decision (``hpc_tools.job.failure_class``), as the keys of its
    ``restarts`` entry: class, decision, why, signature (the exception, to tell a recurring one), fix (oom)."""
    beats = heartbeat.read_all(run.path, start)
    record = beats[found["rank"]].exit if found.get("rank") in beats else None
    previous = manifest.get("restarts") or []
    oom = kernel_oom(run)
    verdict = classify(found["cause"], record, previous, kernel_oom=oom)
    out: dict = {}
    if verdict.decision == RESTART and found["cause"] in ("lost", "exited", "failed"):
        # A rank that raised an error of its own (not a communication error) was not brought down by a peer's death,
        # while srun's --kill-on-bad-exit kills its peers without an exit record: that rank is the culprit (a rank
        # srun saw killed by a signal first, a hang or a lost node stays the culprit).
        # Only while every rank without an exit record was still beating when it raised (a peer that died first, its
        # heartbeat stale, is the culprit whatever the survivor raised).
        raised = sorted((b for b in beats.values() if b.exit and b.exit.get("code") and b.exit.get("error")),
                        key=lambda b: b.exit.get("time") or 0.0)
        silent = [b.time for b in beats.values() if not b.exit]
        for beat in raised:
            own = classify("exited", beat.exit, previous, kernel_oom=oom)
            alive = all(t >= (beat.exit.get("time") or 0.0) - heartbeat.INTERVAL_S - 0.5 for t in silent)
            if own.decision == STOP and alive:
                verdict, record = own, beat.exit
                out = {"cause": "exited", "rank": beat.rank, "node": beat.node,
                       "reason": f"rank {beat.rank} on {beat.node} raised {own.why}"}
                break
    out.update({"class": verdict.cls, "decision": verdict.decision, "why": verdict.why,
                "signature": signature(record)})
    if verdict.fix:
        out["fix"] = verdict.fix
    guard = no_progress(previous)
    if verdict.decision == RESTART and guard is not None:
        out.update(decision=STOP, why=f"no progress: the last two restarts both resumed from checkpoint iteration "
                                      f"{guard} ({verdict.why})")
    return out
