"""status: the state of a run (the latest by default), refreshed from Slurm for Slurm runs, and why it is in it: the
failed rank and node and how it ended, or the hang's culprit. Read-only on a full or read-only disk."""

from __future__ import annotations

import argparse
from pathlib import Path

from hpc_tools.cli._common import add_json, add_run_ref, add_runs_dir, emit_json
from hpc_tools.cli._screen import echo
from profiling import units
from profiling.units import gb, hms, pct, rate, sci, seconds_per_step

NAME = "status"
ORDER = 40
HELP = ("show a run's state and why, the profile it used, layout, times, its figures (median step time, tok/s, MFU, "
        "peak memory), progress (step N/total, loss, lr, grad norm, ETA), straggler verdict, goodput so far, the kept "
        "checkpoints and where the logs are (default: the latest run)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_ref(p, latest=True)
    add_runs_dir(p)
    add_json(p)


def run(args: argparse.Namespace) -> int:
    from hpc_tools.registry import resolve_run
    from hpc_tools.runstate import classify, last_step, refresh_all
    from hpc_tools.runtime.progress import read_progress

    r = resolve_run(args.run, args.runs_dir)
    server = _server(r)
    if r.manifest().get("kind") == "serve":  # a Hugging Face folder served directly: no training to report
        return _serve_only(r, server, args.json)
    ((manifest, job),) = refresh_all([r])
    verdict = classify(r, job, manifest)
    progress = read_progress(r.path)
    health = _health(r)
    saves = _checkpoints(r)
    kept = _kept(saves)
    evaluation = _evaluation(r)
    profile = _profile(r, manifest)
    logs = _logs(r)
    if args.json:
        emit_json({"run_dir": str(r.path), **manifest, **verdict.as_dict(), "last_step": last_step(r),
                   "progress": progress, "lr": (progress or {}).get("lr"),
                   "grad_norm": (progress or {}).get("grad_norm"), "profile": profile, "logs": logs,
                   **health, "checkpoints": saves, "checkpoints_kept": kept, "eval": evaluation})
        return 0
    lines = [f"run      {r.run_id}", f"folder   {r.path}", f"status   {verdict.status}: {verdict.reason}"]
    lines += _job_lines(manifest, profile, r.path)
    lines += _figure_lines(health.get("figures"), progress)
    lines += _health_lines(health)
    lines += _checks_line(manifest)
    lines += _checkpoint_lines(saves, kept)
    lines.append(f"logs     {logs['dir']} ({len(logs['files'])} file(s)); read them with: hpc-tools logs {r.run_id}")
    lines += _restart_lines(manifest)
    if evaluation["results"] or evaluation["quantized"]:  # eval / quantize (hpc_tools.evaluate.results)
        from hpc_tools.evaluate.results import table_lines

        lines += table_lines(r.path)
    lines += _tail_lines(r, manifest, server)
    echo("\n".join(lines))
    return 0


def _job_lines(manifest: dict, profile: dict, run_dir: Path) -> list[str]:
    """What ran where: the profile and the asked-for cluster, layout, the job's times and its end."""
    lines = [f"profile  {profile['text']}"] if profile.get("text") else []
    for key, label in (("layout", "layout"), ("executor", "executor"), ("job_id", "job id"),
                       ("slurm_state", "slurm"), ("nodelist", "nodes")):
        if manifest.get(key) not in (None, ""):
            lines.append(f"{label:<8} {manifest[key]}")
    times = ", ".join(f"{k} {manifest[k]}" for k in ("created", "started", "ended") if manifest.get(k))
    if times:
        lines.append(f"times    {times}")
    ends = [f"{label} {manifest[k]}" for k, label in (("restart_count", "restarts"), ("exit_code", "exit code"),
                                                         ("failed_ranks", "failed ranks"),
                                                         ("failed_nodes", "failed nodes"))
            if manifest.get(k) not in (None, "")]
    if ends:
        lines.append(f"end      {', '.join(ends)}")
    from hpc_tools.render.launchers import LAUNCHERS

    row = LAUNCHERS.get(manifest.get("launcher") or "srun")
    if (row is not None and row.driver) or manifest.get("ray_dashboard"):  # its own cluster: Ray's (docs/ray.md)
        lines.append(f"ray      {manifest.get('ray_nodes') or '?'} node(s), started in "
                     f"{manifest.get('ray_start_s') or '?'} s, dashboard {manifest.get('ray_dashboard') or 'off'} "
                     f"(while the job runs), logs {run_dir / 'ray'}")
    return lines


def _figure_lines(figures: dict | None, progress: dict | None) -> list[str]:
    """The run's figures (median over its measured steps, as summary.json and analyze give them) and where it is:
    step N/total, loss, lr, gradient norm, ETA (rank 0's newest progress line, without its window rates)."""
    lines = []
    if figures and figures.get("step_time_median_s"):
        f = figures
        tflops = f"{f['tflops_per_gpu']:.3g} TFLOP/s/gpu, " if f.get("tflops_per_gpu") is not None else ""
        mem = (f", peak {gb(f['peak_mem_gb'] * units.GB)} ({f.get('peak_mem_kind')})"
               if f.get("peak_mem_gb") is not None else "")
        mfu = pct(f["mfu"]) if f.get("mfu") is not None else "n/a (no GPU peak)"
        lines.append(f"figures  {seconds_per_step(f['step_time_median_s'])} median, {rate(f['tokens_per_s'])} tok/s "
                     f"({rate(f['tokens_per_s_per_gpu'])}/gpu), {tflops}MFU {mfu}{mem}; over "
                     f"{f['steps_measured']} steps after {f['warmup_steps']} warm-up")
    if progress:
        p = progress
        val = (f", val {p['latest_val_loss']:.4f} at step {p.get('val_step')}"
               if p.get("latest_val_loss") is not None else "")
        loss = f"loss {p['loss']:.4f}" if p.get("loss") is not None else "loss -"
        lines.append(f"progress step {p.get('step')}/{p.get('total')}, {loss}{val}, lr {sci(p.get('lr'))}, grad norm "
                     f"{sci(p.get('grad_norm'))}, eta {hms(p.get('eta_s'))}")
    return lines


def _health_lines(health: dict) -> list[str]:
    if not health:
        return []
    lines = [f"stragglers {health['straggler_verdict']}"]
    g = health["goodput"]
    if g.get("hangs"):  # each hang the watchdog named, with the seconds from its phase's last progress to the verdict
        lines.append(f"hangs    {g['hangs']}, named " + ", ".join(f"{s:.0f} s" for s in g["hang_detection_s"] if s)
                     + " after the last progress (the manifest's hangs)")
    if g.get("allocation_hours"):
        fewer = (f"on fewer nodes {g['degraded_s']:.1f} s at {g['degraded_ratio']:.2f}x the throughput, "
                 if g.get("degraded_s") and g.get("degraded_ratio") else "")
        lines.append(f"goodput  {pct(g['goodput'] or 0)} of {g['allocation_hours']:.4g} {g['unit']}-hours "
                     f"({fewer}start-up {g['startup_s']:.0f} s, preflight {g.get('preflight_s') or 0:.1f} s, "
                     f"checkpoint load {g['checkpoint_load_s']:.1f} s, checkpoint "
                     f"blocked {g['checkpoint_blocked_s']:.1f} s, recovery {g.get('recovery_s') or 0:.1f} s, "
                     f"evaluation {g.get('evaluation_s') or 0:.1f} s, lost work {g['lost_work_s']:.1f} s / "
                     f"{g['recomputed_steps']} steps, requeue wait "
                     f"{g['requeue_wait_s']:.0f} s, {g['lives']} start(s))")
    from profiling.post_save import text as post_save_text  # numpy: only where a run has records

    after = post_save_text(health.get("post_save"))
    if after:
        lines.append(f"after saves {after}")
    return lines


def _checks_line(manifest: dict) -> list[str]:
    """Health while training (``hpc_tools.runtime.health``): the checks, their cost, the nodes they named."""
    from hpc_tools.runtime.health_verdict import summary_line

    line = summary_line(manifest.get("health"))
    return [f"health   {line}"] if line else []


def _checkpoint_lines(saves: list, kept: list) -> list[str]:
    """The checkpoints on disk now (their folder and steps), then the saves made: pruned by keep_last, failed,
    written in the background."""
    if not saves and not kept:
        return []
    if kept:
        where = sorted({str(Path(c["path"]).parent) for c in kept})
        steps = ", ".join(str(c["iteration"]) for c in kept)
        line = (f"checkpoints {len(kept)} kept in {', '.join(where)}: step(s) {steps}; newest "
                f"{Path(kept[-1]['path']).name}")
    else:
        line = "checkpoints none on disk"
    done = [c for c in saves if c["verified"] is not False]
    pruned = len([c for c in done if not c["complete"]])
    failed = len(saves) - len(done)
    made = f"; {len(done)} saved" + (f", {pruned} pruned (checkpoint.keep_last)" if pruned else "")
    bg = [c for c in done if c["async"]]
    if bg:
        made += (f"; {len(bg)} in the background: blocked {sum(c['blocked_s'] for c in bg) / len(bg):.3f} s of "
                 f"{sum(c['write_s'] for c in bg) / len(bg):.2f} s written, on average")
    return [line + made + (f"; {failed} failed (not committed)" if failed else "")]


def _restart_lines(manifest: dict) -> list[str]:
    lines = []
    layouts = manifest.get("layouts") or []
    if len(layouts) > 1:  # elastic (cluster.min_nodes): every layout the run trained in, from the step it resumed at
        for entry in layouts:
            lines.append(f"layout   from step {entry.get('from_iteration')}: {entry.get('layout')} "
                         f"({entry.get('cause')})")
    for i, again in enumerate(manifest.get("restarts") or [], 1):  # in-job restarts (cluster.restarts) and requeues
        after = f", first new step {again['time_to_first_step_s']} s later" \
            if again.get("time_to_first_step_s") is not None else ""
        start = f"; resumed from iteration {again['from_iteration']}{after}" \
            if again.get("from_iteration") is not None else ""
        where = f" on {','.join(again['nodes'])}" if again.get("nodes") else ""
        judged = f"; {again['class']}: {again.get('decision')}" if again.get("class") else ""
        why = f" ({again['why']})" if again.get("decision") == "stop" and again.get("why") else ""
        fix = f"; {again['fix']}" if again.get("fix") else ""
        lines.append(f"restart {i} ({again.get('kind', 'in-job')}{where}) at {again.get('at')}: {again.get('cause')}: "
                     f"{again.get('reason') or '?'}{start}{judged}{why}{fix}")
    return lines


def _tail_lines(r, manifest: dict, server: dict | None) -> list[str]:
    from hpc_tools.job.epilogue import earlier_outcome, history
    from hpc_tools.runstate import hang_markers, is_terminal

    lines = [_server_line(server, manifest.get("endpoint"))] if server else []
    ended = is_terminal(manifest.get("state"))
    # a live run's error from before its latest start is an earlier life's (the epilogue moves it into ``lives`` only
    # when that life ends): shown as that life's, not as this one's
    earlier = {} if ended else earlier_outcome(manifest)
    if manifest.get("error") and "error" not in earlier:
        lines.append(f"error    {manifest['error']}")
    # each life's end (job.epilogue; a live run's also the earlier life no epilogue recorded, as the epilogue will
    # record it); an ended run's last is the one shown above
    lives = (manifest.get("lives") or []) if ended else history(manifest, earlier)
    for life in lives[:-1] if ended else lives:
        why = "; ".join(str(life[k]) for k in ("reason", "error") if life.get(k))
        start = "?" if life.get("restart") is None else life["restart"]
        if why:
            lines.append(f"earlier  start {start} ended {life.get('state') or '?'}: {why}")
    lines += [f"hang     {marker}" for marker in hang_markers(r)]  # the hang verdict with every rank's stacks
    return lines


def _kept(saves: list) -> list:
    """The saves still on disk and complete (``checkpoint.keep_last`` prunes older ones), oldest first."""
    return [c for c in saves if c.get("complete") and c.get("verified") is not False]


def _profile(r, manifest: dict) -> dict:
    """The recipe profile the run used, the cluster the recipe asks for and why they differ: {used, asked, ran,
    text}. A local run takes the recipe's ``local:`` profile (``submit`` picks it when it runs locally)."""
    from hpc_tools.recipe.load import load_recipe

    used = manifest.get("profile")
    try:
        ran = load_recipe(r.recipe_path, check=False)  # as it ran: the rules were checked at submission
    except Exception:  # noqa: BLE001 - status reports the state whatever the run folder holds
        return {"used": used, "asked": None, "ran": None, "text": f"{used}" if used else ""}
    c = ran.cluster
    ran_text = f"{c.nodes} x {c.gpus_per_node} {c.gpu_type}"
    asked_text = _asked_cluster(manifest.get("source")) if used else None
    out = {"used": used or "none", "asked": asked_text, "ran": ran_text}
    if not used:
        out["text"] = f"the recipe's own cluster: {ran_text}"
    else:
        asked = f"; the recipe asks for {asked_text}" if asked_text and asked_text != ran_text else ""
        out["text"] = (f"{used}: ran on {ran_text}{asked} ({manifest.get('executor')} run: a run without Slurm uses "
                       "the recipe's local profile; submit --executor slurm runs the recipe's cluster)")
    return out


def _asked_cluster(source: str | None) -> str | None:
    """``nodes x gpus_per_node gpu_type`` of the recipe file the run came from, when it is still readable."""
    if not source:
        return None
    try:
        from hpc_tools.recipe.load import load_recipe

        c = load_recipe(source, check=False).cluster
    except Exception:  # noqa: BLE001 - moved or edited since: the profile line says less
        return None
    return f"{c.nodes} x {c.gpus_per_node} {c.gpu_type}"


def _logs(r) -> dict:
    """Where the run's logs are: their folder and files (``runstate.log_files``)."""
    from hpc_tools.runstate import log_files

    try:
        files = [str(p) for p in log_files(r)]
    except OSError:
        files = []
    folders = sorted({str(Path(f).parent) for f in files}) or [str(r.logs_dir)]
    return {"dir": ", ".join(folders), "files": files}


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
