"""status: the state of a run (the latest by default), refreshed from Slurm for Slurm runs, and why it is in it: the
failed rank and node and how it ended, or the hang's culprit. Read-only on a full or read-only disk."""

from __future__ import annotations

import argparse

from hpc_tools.cli._common import add_json, add_run_ref, add_runs_dir, emit_json

NAME = "status"
ORDER = 40
HELP = ("show a run's state and why, job id, layout, times, last step, progress (step N/total, ETA, validation loss), "
        "straggler verdict and goodput so far (default: the latest run)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_ref(p, latest=True)
    add_runs_dir(p)
    add_json(p)


def run(args: argparse.Namespace) -> int:
    from hpc_tools.registry import resolve_run
    from hpc_tools.runstate import classify, hang_markers, last_step, refresh_all
    from hpc_tools.runtime.progress import read_progress

    r = resolve_run(args.run, args.runs_dir)
    server = _server(r)
    if r.manifest().get("kind") == "serve":  # a Hugging Face folder served directly: no training to report
        return _serve_only(r, server, args.json)
    ((manifest, job),) = refresh_all([r])
    verdict = classify(r, job, manifest)
    step = last_step(r)
    progress = read_progress(r.path)
    health = _health(r)
    saves = _checkpoints(r)
    evaluation = _evaluation(r)
    if args.json:
        emit_json({"run_dir": str(r.path), **manifest, **verdict.as_dict(), "last_step": step, "progress": progress,
                   **health, "checkpoints": saves, "eval": evaluation})
        return 0
    keys = ("state", "slurm_state", "executor", "job_id", "layout", "nodelist", "created", "started", "ended",
            "restart_count", "exit_code", "failed_ranks", "failed_nodes")
    print(f"run      {r.run_id}\nfolder   {r.path}\nstatus   {verdict.status}: {verdict.reason}")
    for key in keys:
        if manifest.get(key) not in (None, ""):
            print(f"{key:<8} {manifest[key]}" if len(key) <= 8 else f"{key} {manifest[key]}")
    if manifest.get("launcher") == "ray" or manifest.get("ray_dashboard"):  # cluster.launcher: ray (docs/ray.md)
        print(f"ray      {manifest.get('ray_nodes') or '?'} node(s), started in {manifest.get('ray_start_s') or '?'} "
              f"s, dashboard {manifest.get('ray_dashboard') or 'off'} (while the job runs), logs {r.path / 'ray'}")
    if step:
        loss = f", loss {step['loss']:.4f}" if step.get("loss") is not None else ""
        print(f"last step {step['step']}{loss}, {step['step_time_s']:.3f} s/step, {step['tokens_per_s']:.0f} tok/s")
    if progress:  # rank 0's newest progress line: step N/total, rates, elapsed and ETA
        print(f"progress {progress.get('line', '')}")
        if progress.get("latest_val_loss") is not None:
            print(f"val loss {progress['latest_val_loss']:.4f} at step {progress.get('val_step')}")
    if health:
        g = health["goodput"]
        print(f"stragglers {health['straggler_verdict']}")
        if g.get("allocation_hours"):
            fewer = (f"on fewer nodes {g['degraded_s']:.1f} s at {g['degraded_ratio']:.2f}x the throughput, "
                     if g.get("degraded_s") and g.get("degraded_ratio") else "")
            print(f"goodput  {100 * (g['goodput'] or 0):.1f} % of {g['allocation_hours']:.4g} {g['unit']}-hours "
                  f"({fewer}start-up {g['startup_s']:.0f} s, preflight {g.get('preflight_s') or 0:.1f} s, "
                  f"checkpoint load {g['checkpoint_load_s']:.1f} s, checkpoint "
                  f"blocked {g['checkpoint_blocked_s']:.1f} s, recovery {g.get('recovery_s') or 0:.1f} s, "
                  f"evaluation {g.get('evaluation_s') or 0:.1f} s, lost work {g['lost_work_s']:.1f} s / "
                  f"{g['recomputed_steps']} steps, requeue wait "
                  f"{g['requeue_wait_s']:.0f} s, {g['lives']} start(s))")
    if saves:
        done = [c for c in saves if c["verified"] is not False]
        bg = [c for c in done if c["async"]]
        line = f"checkpoints {len(done)} saved, newest step {done[-1]['iteration']} ({done[-1]['tier']} tier)" \
            if done else "checkpoints none complete"
        if bg:
            line += (f"; {len(bg)} in the background: blocked {sum(c['blocked_s'] for c in bg) / len(bg):.3f} s of "
                     f"{sum(c['write_s'] for c in bg) / len(bg):.2f} s written, on average")
        failed = len(saves) - len(done)
        print(line + (f"; {failed} failed (not committed)" if failed else ""))
    layouts = manifest.get("layouts") or []
    if len(layouts) > 1:  # elastic (cluster.min_nodes): every layout the run trained in, from the step it resumed at
        for entry in layouts:
            print(f"layout   from step {entry.get('from_iteration')}: {entry.get('layout')} ({entry.get('cause')})")
    for i, again in enumerate(manifest.get("restarts") or [], 1):  # in-job restarts (cluster.restarts) and requeues
        after = f", first new step {again['time_to_first_step_s']} s later" \
            if again.get("time_to_first_step_s") is not None else ""
        start = f"; resumed from iteration {again['from_iteration']}{after}" \
            if again.get("from_iteration") is not None else ""
        where = f" on {','.join(again['nodes'])}" if again.get("nodes") else ""
        judged = f"; {again['class']}: {again.get('decision')}" if again.get("class") else ""
        why = f" ({again['why']})" if again.get("decision") == "stop" and again.get("why") else ""
        fix = f"; {again['fix']}" if again.get("fix") else ""
        print(f"restart {i} ({again.get('kind', 'in-job')}{where}) at {again.get('at')}: {again.get('cause')}: "
              f"{again.get('reason') or '?'}{start}{judged}{why}{fix}")
    if evaluation["results"] or evaluation["quantized"]:  # eval / quantize (hpc_tools.evaluate.results)
        from hpc_tools.evaluate.results import table_lines

        print("\n".join(table_lines(r.path)))
    if server:
        print(_server_line(server, manifest.get("endpoint")))
    if manifest.get("error"):
        print(f"error    {manifest['error']}")
    for marker in hang_markers(r):  # the hang verdict with every rank's stacks
        print(f"hang     {marker}")
    return 0


def _checkpoints(r) -> list:
    """The run's saves (``analysis.live.checkpoint_saves``); [] when its events cannot be read."""
    from hpc_tools.analysis.live import checkpoint_saves

    try:
        return checkpoint_saves(r)
    except Exception:  # noqa: BLE001 - status reports the state whatever the records hold
        return []


def _evaluation(r) -> dict:
    """The run's eval/ folder (scores, quantized models, score deltas); empty lists when there is none."""
    from hpc_tools.evaluate.results import summary

    try:
        return summary(r.path)
    except Exception:  # noqa: BLE001 - status reports the state whatever the folder holds
        return {"results": [], "quantized": [], "score_deltas": []}


def _health(r) -> dict:
    """Straggler verdict and goodput from the records so far; a status never fails for them (unreadable records)."""
    from hpc_tools.analysis.live import stragglers_and_goodput
    from profiling.records import rank_files

    try:
        return stragglers_and_goodput(r) if rank_files(r.records_dir) else {}
    except Exception as exc:  # noqa: BLE001 - status reports the state whatever the records hold
        return {"straggler_verdict": f"not measured: {type(exc).__name__}: {exc}"[:200],
                "goodput": {}, "stragglers": "", "straggler_nodes": ""}


def _server(r) -> dict | None:
    """The run's serving record, its state read live (``serving.job.refresh``: a server gone clears the endpoint)."""
    from hpc_tools.serving.job import refresh

    return refresh(r)


def _server_line(server: dict, endpoint: dict | None) -> str:
    where = f"Slurm job {server['job_id']}" if server.get("job_id") else f"local, process group {server.get('pid')}"
    if endpoint:
        return (f"endpoint http://{endpoint['host']}:{endpoint['http_port']} (gRPC {endpoint.get('grpc_port')}), "
                f"{server.get('engine')} serving {server.get('model_dir')} since {server.get('ready')} ({where})")
    return f"server   {server.get('state')} ({server.get('engine')}, {where}, ended {server.get('ended')})"


def _serve_only(r, server: dict | None, as_json: bool) -> int:
    manifest = r.manifest()
    if as_json:
        emit_json({"run_dir": str(r.path), **manifest})
        return 0
    print(f"run      {r.run_id}\nfolder   {r.path}\nkind     serve ({manifest.get('model_dir')})")
    print(_server_line(server, manifest.get("endpoint")) if server else "server   never started")
    return 0
