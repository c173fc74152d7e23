"""Measured layout search: the planner's top K candidates run as a short sweep, ranked by what they measure.

``plan --search --measure K`` and ``submit --auto --measure K`` take the K fastest configurations of the analytic
search (``planner/search.py``), run each for a few steps as one cell of a sweep (``hpc_tools/sweep``: on Slurm one job
array per resource shape, locally one run after another), read each run's records through ``profiling/figures.py``
(the one owner of measured figures, warm-up rule included: ``calibrate.read_run``), rank them by measured step time,
show predicted next to measured, and feed the runs to the calibration (``calibrate.calibrate_runs``).

Each candidate is the same recipe with the candidate's layout overrides, run for ``profiling.warmup_steps`` +
``steps`` steps (``measure_overrides``). A candidate that fails (out of memory, an error, a rule its overrides break)
stays in the report with its status and reason, after the measured ones.

CPU ranks have no peak FLOP/s (``profiling/peaks.py`` refuses to guess one), and the analytic ranking needs one. The
search then orders candidates with ``CPU_PLANNING_PEAK_TFLOPS`` (planning only: the runs' recipes and records never
carry it, so no MFU is ever computed against it) and the calibration fits the efficiency relative to that same peak,
so later measured searches on CPU predict with it. docs/formulas.md ("Measured layout search") states this.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import yaml

from hpc_tools.errors import RecipeError, UserError

if TYPE_CHECKING:
    from hpc_tools.planner.calibrate import Measured
    from hpc_tools.planner.search import Candidate
    from hpc_tools.recipe.schema import Recipe

DEFAULT_MEASURE_STEPS = 5
# One x86 core's fp32 FMA peak, order of magnitude: 2 FMA units x 8 lanes (AVX2) x 2 FLOP x ~3 GHz ~ 0.1 TFLOP/s.
# Used only to order CPU candidates before measuring them; the calibration absorbs how far off it is.
CPU_PLANNING_PEAK_TFLOPS = 0.1
NOT_RUN = "invalid"  # status of a candidate whose overrides break a recipe rule (never submitted)

Say = Callable[[str], None]


@dataclass
class Outcome:
    """One candidate: its predicted rank and figures, the run that measured it, and what it measured."""

    predicted_rank: int  # 1 = the analytic search's fastest
    config: str  # Knobs.describe()
    overrides: list[str]  # the --set strings that give the candidate's layout
    predicted_step_s: float | None
    predicted_memory_bytes: float | None
    status: str = "pending"  # a cell status (hpc_tools.runstate.STATUSES), or "invalid"
    reason: str = ""
    run_dir: str | None = None
    job_id: str | None = None
    measured: "Measured | None" = None
    predicted_step_s_after_fit: float | None = None

    @property
    def measured_step_s(self) -> float | None:
        return self.measured.step_time_s if self.measured else None

    @property
    def ratio(self) -> float | None:
        """measured / predicted step time."""
        if self.measured_step_s is None or not self.predicted_step_s:
            return None
        return self.measured_step_s / self.predicted_step_s

    def as_dict(self) -> dict[str, Any]:
        m = self.measured
        return {"predicted_rank": self.predicted_rank, "config": self.config, "overrides": self.overrides,
                "status": self.status, "reason": self.reason, "run_dir": self.run_dir, "job_id": self.job_id,
                "predicted_step_s": self.predicted_step_s, "measured_step_s": self.measured_step_s,
                "measured_over_predicted": self.ratio,
                "predicted_step_s_after_fit": self.predicted_step_s_after_fit,
                "steps_measured": m.steps if m else None,
                "predicted_memory_bytes": self.predicted_memory_bytes,
                "measured_mem_allocated_max_bytes": m.mem_allocated_max_bytes if m else None}


@dataclass
class MeasureReport:
    """The measured search: outcomes ranked by measured step time (failures last), and the calibration it fed."""

    recipe: str
    executor: str
    profile: str | None
    steps: int  # measured steps per candidate
    warmup_steps: int
    efficiency: float
    efficiency_source: str
    outcomes: list[Outcome]
    sweep: str | None = None
    planning_peak_tflops: float | None = None  # set when the CPU planning peak ordered the candidates
    calibration: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def measured(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.measured_step_s is not None]

    @property
    def winner(self) -> Outcome | None:
        return self.measured[0] if self.measured else None

    def as_dict(self) -> dict[str, Any]:
        winner = self.winner
        return {"recipe": self.recipe, "executor": self.executor, "profile": self.profile, "sweep": self.sweep,
                "steps_per_candidate": self.steps, "warmup_steps": self.warmup_steps,
                "efficiency": self.efficiency, "efficiency_source": self.efficiency_source,
                "planning_peak_tflops": self.planning_peak_tflops,
                "candidates": [o.as_dict() for o in self.outcomes],
                "measured": len(self.measured), "failed": len(self.outcomes) - len(self.measured),
                "winner": winner.as_dict() if winner else None,
                "rank_agreement": rank_agreement(self.outcomes),
                "calibration": self.calibration, "notes": self.notes}


def rank_outcomes(outcomes: list[Outcome]) -> list[Outcome]:
    """Measured candidates by measured step time (ties: the predicted order), then the rest in predicted order."""
    done = sorted((o for o in outcomes if o.measured_step_s is not None),
                  key=lambda o: (o.measured_step_s, o.predicted_rank))
    rest = sorted((o for o in outcomes if o.measured_step_s is None), key=lambda o: o.predicted_rank)
    return done + rest


def rank_agreement(outcomes: list[Outcome]) -> dict[str, Any]:
    """How well the analytic order matches the measured one: Kendall's tau over the pairs of measured candidates
    whose predicted step times differ (1 = same order, -1 = reversed; None without such a pair: the model calls
    them equal), and whether the predicted best measured fastest."""
    done = [o for o in outcomes if o.measured_step_s is not None and o.predicted_step_s is not None]
    concordant = discordant = 0
    for i, a in enumerate(done):
        for b in done[i + 1:]:
            if abs(a.predicted_step_s - b.predicted_step_s) <= 1e-9 * max(a.predicted_step_s, b.predicted_step_s):
                continue  # a predicted tie says nothing about the order
            sign = (a.predicted_step_s - b.predicted_step_s) * (a.measured_step_s - b.measured_step_s)
            concordant += sign > 0
            discordant += sign < 0
    pairs = concordant + discordant
    best = rank_outcomes(outcomes)[0] if done else None
    tau = (concordant - discordant) / pairs if pairs else None
    return {"pairs": pairs, "concordant": concordant, "kendall_tau": tau,
            "predicted_best_won": None if best is None else best.predicted_rank == min(o.predicted_rank for o in done)}


def measure_overrides(recipe: "Recipe", steps: int) -> list[str]:
    """The --set strings that turn a recipe into a short measurement run: warm-up + ``steps`` steps, no checkpoint
    before the end, and a learning-rate warm-up that fits the shorter run (speed does not depend on the rate)."""
    if steps < 1:
        raise UserError(f"--measure-steps {steps} must be >= 1 (measured steps per candidate, after "
                        f"profiling.warmup_steps={recipe.profiling.warmup_steps} warm-up steps)")
    iters = recipe.profiling.warmup_steps + steps
    out = [f"training.train_iters={iters}", "checkpoint.interval_iters=0"]
    if recipe.training.lr_warmup_iters > iters:
        out.append(f"training.lr_warmup_iters={iters}")
    return out


def planning_recipe(recipe: "Recipe") -> tuple["Recipe", float | None]:
    """The recipe the search ranks (and the calibration fits) with: on CPU ranks without a peak, the recipe with
    ``CPU_PLANNING_PEAK_TFLOPS``; else the recipe itself. Returns (recipe, the planning peak or None)."""
    c = recipe.cluster
    if c.uses_gpus or c.gpu_peak_tflops is not None:
        return recipe, None
    cluster = c.model_copy(update={"gpu_peak_tflops": CPU_PLANNING_PEAK_TFLOPS})
    return recipe.model_copy(update={"cluster": cluster}), CPU_PLANNING_PEAK_TFLOPS


def _parse(override: str) -> tuple[str, Any]:
    key, _, value = override.partition("=")
    return key, yaml.safe_load(value)


def _candidate_cells(raw: dict, source: str, profile: str | None, user: list[str], extra: list[str],
                     candidates: list["Candidate"]):
    """Sweep cells, one per candidate: the recipe with the user's --set, the candidate's layout, then the measurement
    overrides. A candidate whose recipe breaks a rule becomes a cell without a recipe and its reason."""
    from hpc_tools.recipe.load import resolve
    from hpc_tools.sweep.grid import Cell

    class CandidateCell(Cell):
        def label(self) -> str:  # the planner's short name (TP2 PP1 DP2 SP mb1 ...), not nine key=value pairs
            return candidates[self.index].knobs.describe()

    cells = []
    for index, cand in enumerate(candidates):
        overrides = cand.knobs.overrides()
        cell = CandidateCell(index=index, params=dict(_parse(o) for o in overrides), overrides=overrides)
        try:
            cell.recipe = resolve(raw, user + overrides + extra, profile, source)
        except RecipeError as exc:
            cell.reasons = [str(v) for v in exc.violations]
        except UserError as exc:
            cell.reasons = [str(exc)]
        cells.append(cell)
    return cells


def _grid(cells) -> dict[str, list[list[Any]]]:
    """The candidates as one zipped sweep axis (sweep.json lists it like any grid); keys one candidate lacks (the
    full-recompute knobs) are null for it."""
    keys: list[str] = []
    for c in cells:
        keys += [k for k in c.params if k not in keys]
    return {",".join(keys): [[c.params.get(k) for k in keys] for c in cells]}


def _wait_slurm(folder, say: Say, poll_s: float) -> dict[str, Any]:
    """Poll the sweep (one sacct call per poll) until every cell has ended; Ctrl-C cancels the measurement jobs."""
    from hpc_tools.runstate import LIVE_STATUSES
    from hpc_tools.sweep.runner import refresh
    from hpc_tools.sweep.submit import submit_due

    last = ""
    try:
        while True:
            data = refresh(folder)
            if submit_due(folder, say):  # candidates beyond Slurm's limits go in as earlier ones end
                data = folder.read()
            live = [c for c in data["cells"] if c["status"] in LIVE_STATUSES]
            line = ", ".join(f"{c['id']} {c['status']}" for c in data["cells"])
            if line != last:
                say(f"measuring: {line}")
                last = line
            if not live:
                return data
            time.sleep(poll_s)
    except KeyboardInterrupt:
        from hpc_tools.executors.slurm import cancel

        for c in folder.read()["cells"]:
            if c.get("job_id"):
                try:
                    cancel(str(c["job_id"]))
                except Exception:  # noqa: BLE001 - best effort: already ended, or the controller is away
                    pass
        say(f"cancelled the measurement jobs of {folder.path}")
        raise


def collect(outcomes: list[Outcome], cells: list[dict[str, Any]], sweep_dir: Path) -> None:
    """Fill each outcome from its sweep cell (by cell index = predicted rank - 1): status, reason, job id, and for a
    completed run its measured figures (``calibrate.read_run``, i.e. ``profiling.figures``)."""
    from hpc_tools.planner.calibrate import read_run

    by_index = {c["cell"]: c for c in cells}
    for o in outcomes:
        cell = by_index.get(o.predicted_rank - 1)
        if cell is None:
            continue
        o.run_dir = str(sweep_dir / cell["run_dir"])
        o.job_id = cell.get("job_id")
        o.status, o.reason = cell["status"], cell.get("reason") or ""
        if o.status != "completed":
            continue
        try:
            o.measured = read_run(o.run_dir)
        except UserError as exc:
            o.status, o.reason = "failed", str(exc)
            continue
        if o.measured.step_time_s is None:
            o.status, o.reason = "failed", (f"no measured steps after the {o.measured.recipe.profiling.warmup_steps} "
                                            "warm-up steps (raise --measure-steps)")
            o.measured = None


def feed_calibration(report: MeasureReport, store: Path | None, save: bool) -> None:
    """Fit the efficiency from the measured runs (``calibrate.calibrate_runs``) and note each candidate's prediction
    after the fit. On CPU the runs' recipes get the planning peak first: the fit is relative to the peak the search
    predicted with."""
    from hpc_tools.planner.calibrate import calibrate_runs

    done = report.measured
    if not done:
        return
    runs = [dataclasses.replace(o.measured, recipe=planning_recipe(o.measured.recipe)[0]) for o in done]
    cal = calibrate_runs(runs, store=store, save=save, efficiency=report.efficiency)
    after = {row["run"]: row["predicted_step_s_after_fit"] for row in cal["runs"]}
    for o in done:
        o.predicted_step_s_after_fit = after.get(o.measured.run)
    report.calibration = cal


def measured_search(recipe_path: str | Path, k: int, overrides: list[str] = (), profile: str | None = None,
                    executor: str = "auto", steps: int = DEFAULT_MEASURE_STEPS, root: str | Path | None = None,
                    efficiency: float | None = None, use_calibration: bool = True, calibration: Path | None = None,
                    save: bool = True, say: Say = print, poll_s: float = 3.0) -> MeasureReport:
    """Run the analytic search's top ``k`` candidates for ``steps`` measured steps each and rank them by measured
    step time (see the module docstring). Locally (no Slurm, or ``executor="local"``) the recipe's local profile
    applies, as for ``submit``, and the search covers that profile's world (its cluster.nodes x gpus_per_node)."""
    from hpc_tools.planner.efficiency import resolve_efficiency
    from hpc_tools.planner.search import search
    from hpc_tools.planner.steptime import DEFAULT_EFFICIENCY
    from hpc_tools.recipe.load import read_yaml, resolve
    from hpc_tools.submission import choose_executor

    if k < 1:
        raise UserError(f"--measure {k} must be >= 1 (the number of candidates to run)")
    source, user = str(recipe_path), list(overrides)
    raw = read_yaml(recipe_path)
    chosen, note = choose_executor(executor)
    if note:
        say(note)
    if profile is None and chosen == "local" and raw.get("local") is not None:
        profile = "local"
    recipe = resolve(raw, user, profile, source, check=False)  # the search turns the layout and checks candidates
    extra = measure_overrides(recipe, steps)
    planning, peak = planning_recipe(recipe)
    eff, eff_source = resolve_efficiency(planning, efficiency, calibration, use_calibration)
    eff = DEFAULT_EFFICIENCY if eff is None else eff
    result = search(planning, top=k, losers=0, efficiency=eff, use_calibration=False)
    if result.best is None:
        raise UserError(f"none of the {result.enumerated} configurations of {recipe.name} for "
                        f"{recipe.cluster.nodes}x{recipe.cluster.gpus_per_node} {recipe.cluster.gpu_type} fits and "
                        "keeps the rules, so there is nothing to measure (`plan --search` shows why)")
    candidates = result.ranked[:k]
    report = MeasureReport(recipe=recipe.name, executor=chosen, profile=profile, steps=steps,
                           warmup_steps=recipe.profiling.warmup_steps, efficiency=eff, efficiency_source=eff_source,
                           outcomes=[Outcome(i, c.knobs.describe(), c.knobs.overrides(), c.step_s, c.memory_bytes)
                                     for i, c in enumerate(candidates, 1)], planning_peak_tflops=peak)
    if len(candidates) < k:
        report.notes.append(f"only {len(candidates)} configuration(s) fit and keep the rules; measuring those")
    if peak:
        report.notes.append(f"{recipe.cluster.gpu_type} ranks have no peak FLOP/s: candidates are predicted with a "
                            f"planning peak of {peak} TFLOP/s per rank (never recorded as MFU)")
    cells = _candidate_cells(raw, source, profile, user, extra, candidates)
    _run_cells(report, cells, source, root, user + extra, say, poll_s)
    feed_calibration(report, calibration, save)
    report.outcomes = rank_outcomes(report.outcomes)
    return report


def _run_cells(report: MeasureReport, cells: list, source: str, root: str | Path | None, base_overrides: list[str],
               say: Say, poll_s: float) -> None:
    """The candidates' cells run as one sweep on ``report.executor`` and waited for, their figures collected into
    ``report.outcomes``; a cell that is not valid is not run (its reasons are the outcome's)."""
    from hpc_tools.recipe.sweep import SweepConfig
    from hpc_tools.sweep.grid import SweepPlan
    from hpc_tools.sweep.runner import create_sweep, submit_cells

    for cell, o in zip(cells, report.outcomes):
        if not cell.valid:
            o.status, o.reason = NOT_RUN, "; ".join(cell.reasons)
    valid = [c for c in cells if c.valid]
    if not valid:
        return
    chosen = report.executor
    plan = SweepPlan(name=f"{report.recipe}-measure", config=SweepConfig(grid=_grid(cells), scaling="none"),
                     cells=cells, base_overrides=base_overrides, profile=report.profile)
    folder = create_sweep(plan, source, chosen, root)
    report.sweep = str(folder.path)
    say(f"measuring {len(valid)} candidate(s), {report.warmup_steps} warm-up + {report.steps} measured step(s) each, "
        f"executor {chosen}: {folder.path}")
    submit_cells(folder, [c["id"] for c in folder.read()["cells"]], chosen, say)
    data = _wait_slurm(folder, say, poll_s) if chosen == "slurm" else folder.read()
    collect(report.outcomes, data["cells"], folder.path)


def _memory(value: float | None, unit) -> str:
    if value is None:
        return "-"
    div, name = unit(value)
    return f"{value / div:.2f} {name}"


def print_measure(report: MeasureReport) -> None:
    """The measured ranking as a table: predicted vs measured step time per candidate, failures with their reason."""
    from hpc_tools.planner.report import _console, _esc, _table, _unit, set_args

    con = _console()

    def num(value, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    for line in report.notes:
        con.print(f"note: {line}", highlight=False)
    table = _table(f"{report.recipe}: {len(report.outcomes)} candidate(s) measured for {report.steps} step(s) after "
                   f"{report.warmup_steps} warm-up, ranked by measured step time ({report.executor})",
                   "#", "pred. #", "step s meas.", "pred.", "meas./pred.", "pred. after fit", "pred. mem", "status",
                   "configuration")
    rank = 0
    for o in report.outcomes:
        done = o.measured_step_s is not None
        rank += done
        table.add_row(str(rank) if done else "-", str(o.predicted_rank), num(o.measured_step_s, ".4f"),
                      num(o.predicted_step_s, ".4f"), num(o.ratio, ".2f"), num(o.predicted_step_s_after_fit, ".4f"),
                      _memory(o.predicted_memory_bytes, _unit), o.status,
                      _esc(o.config))
    con.print(table)
    for o in report.outcomes:
        if o.measured_step_s is None:
            con.print(f"{o.status}: predicted #{o.predicted_rank} {o.config}: {o.reason or 'no reason recorded'}"
                      + (f" ({o.run_dir})" if o.run_dir else ""), highlight=False)
    agree = rank_agreement(report.outcomes)
    if agree["predicted_best_won"] is not None:
        tau = ("no pair the model tells apart" if agree["kendall_tau"] is None else
               f"Kendall tau {agree['kendall_tau']:+.2f} over {agree['pairs']} pair(s) the model tells apart")
        con.print(f"analytic vs measured order: {tau}; the predicted best "
                  f"{'measured fastest' if agree['predicted_best_won'] else 'did not win'}", highlight=False)
    cal = report.calibration
    if cal is not None:
        for key, entry in cal["fitted"].items():
            con.print(f"calibration {key}: efficiency {report.efficiency:.4g} ({report.efficiency_source}) -> "
                      f"{entry['efficiency']:.4g} fitted from {len(entry['runs'])} run(s)"
                      + (f", stored in {cal['store']}" if cal["store"] else " (not stored: --no-save)"),
                      highlight=False)
        if not cal["fitted"]:
            con.print("calibration: no efficiency fitted (no measured step time exceeds the modelled communication)",
                      highlight=False)
    winner = report.winner
    if winner is None:
        con.print("no candidate measured a step time: nothing to choose", style="bold red")
        return
    con.print(f"Measured best: {winner.config} ({winner.measured_step_s:.4f} s/step)", highlight=False)
    con.print("Apply it: " + set_args(winner.overrides), highlight=False, soft_wrap=True)
    if report.sweep:
        con.print(f"runs: {report.sweep}", highlight=False)
