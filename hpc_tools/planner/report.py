"""Human-readable tables (rich) and JSON for plan, search and calibration results."""

from __future__ import annotations

from typing import Any

from hpc_tools.planner.estimate import Plan
from hpc_tools.planner.hardware import GB
from hpc_tools.planner.search import SearchResult, why_slower
from hpc_tools.planner.unmodelled import memory_not_modelled
from profiling.units import pct

WIDTH = 160  # the tables' width when the command line gives none (``plan`` passes the terminal's)
_width = WIDTH
_line_width: int | None = None  # where the apply line breaks (None: never, e.g. into a pipe, read by scripts)


def set_width(columns: int, line_columns: int | None = None) -> None:
    """Fit the tables that follow to ``columns`` and break the apply line at ``line_columns`` (``plan`` calls it
    with the terminal's width)."""
    global _width, _line_width
    _width, _line_width = columns, line_columns


def apply_text(changes: list[str]) -> str:
    """``Apply the best: --set A --set B``, broken into shell continuation lines (`` \\``) where it would pass the
    line width: pasted into a shell it is still one command."""
    if not changes:
        return "The best is the recipe's own layout: nothing to change"
    words = ["Apply the best:", *(set_args([o]) for o in changes)]
    if _line_width is None or len(" ".join(words)) <= _line_width:
        return " ".join(words)
    lines, line = [], words[0]
    for word in words[1:]:
        if len(line) + 1 + len(word) + 2 > _line_width:
            lines.append(line + " \\")
            line = "  " + word
        else:
            line += " " + word
    return "\n".join([*lines, line])


def _console():
    from rich.console import Console

    return Console(width=_width)


def _table(title: str, *columns: str):
    from rich.table import Table

    table = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    for i, col in enumerate(columns):
        table.add_column(col, justify="right" if 0 < i < len(columns) - 1 else "left",
                         overflow="fold", max_width=100 if i == len(columns) - 1 else None)
    return table


def _esc(text: str) -> str:
    """Cell text taken literally (rich would read [..] as markup)."""
    from rich.markup import escape

    return escape(text)


def count(n: float) -> str:
    """12.3 B / 45.6 M / 7.8 k parameters."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f}"


def _unit(total_bytes: float) -> tuple[float, str]:
    """GB for GPU-sized figures, MB for the tiny models of local runs."""
    return (GB, "GB") if total_bytes >= 0.1 * GB else (1e6, "MB")


def _headline(plan: Plan) -> str:
    hw, lay = plan.hardware, plan.knobs.layout
    mem = f"{hw.mem_bytes / GB:.1f} GB" if hw.mem_bytes else "no GPU memory"
    peak = f", {hw.peak_flops / 1e12:.0f} TFLOP/s {plan.knobs.precision}" if hw.peak_flops else ""
    active = (f" ({count(plan.parameters_active)} active per token, counting the input embedding; "
              f"{count(plan.parameters_active_without_input_embedding)} without it)"
              if plan.parameters_active and plan.parameters_active != plan.parameters else "")
    return (f"{plan.name}: {count(plan.parameters)} parameters{active}, {plan.knobs.backend}, on {lay.nodes} x "
            f"{lay.ranks_per_node} {hw.gpu_type} ({mem}{peak})\n{lay.describe()}; {plan.knobs.describe()}")


def mfu_text(plan: Plan) -> str:
    """MFU against the 16-bit peak, and for FP8 runs also against the FP8 peak, each named."""
    t = plan.time
    out = f"MFU {t.mfu:.1%} of the {plan.knobs.precision} peak"
    if t.mfu_fp8 is not None:
        out += f", {t.mfu_fp8:.1%} of the FP8 peak"
    return out


def verdict(plan: Plan) -> str:
    total = plan.memory.total
    if plan.fits is None:
        div, unit = _unit(total)
        return f"peak {total / div:.2f} {unit} per rank; no GPU memory to check ({plan.hardware.gpu_type})"
    share = total / plan.hardware.mem_bytes
    word = "FITS" if plan.fits else "DOES NOT FIT"
    return (f"{word}: {total / GB:.1f} GB of {plan.hardware.mem_bytes / GB:.1f} GB per GPU ({share:.0%}); limit "
            f"{plan.usable_bytes / GB:.1f} GB after {plan.headroom_bytes / GB:.1f} GB headroom ({plan.headroom_note})")


def verdict_line(plan: Plan, recipe_ref: str) -> str:
    """One line: fits or not, the memory term that limits it (the largest) and the step time's largest term, then
    where to look for a better layout (``plan RECIPE --search``)."""
    peak = plan.memory.peak
    name, value = max(peak.terms.items(), key=lambda kv: kv[1])
    div, unit = _unit(peak.total)
    largest = f"largest memory term {name} {value / div:.2f} {unit} ({pct(value / peak.total, 0)})"
    if plan.fits is None:
        head = f"verdict: no GPU memory to check ({plan.hardware.gpu_type}), {peak.total / div:.2f} {unit} per rank"
    else:
        word = "fits" if plan.fits else "DOES NOT FIT"
        head = (f"verdict: {word}, {peak.total / GB:.1f} of {plan.usable_bytes / GB:.1f} GB usable per GPU "
                f"({pct(peak.total / plan.usable_bytes, 0)})")
    step = ""
    if plan.time is not None:
        t = plan.time
        term, secs = max(t.terms.items(), key=lambda kv: kv[1])
        step = f"; step {t.total_s:.3f} s, mostly {term} ({pct(secs / t.total_s, 0)})"
    want = "a layout that fits" if plan.fits is False else "faster layouts"
    return f"{head}; {largest}{step}; {want}: plan {recipe_ref} --search"


def print_plan(plan: Plan) -> None:
    con = _console()
    notes = plan.notes()
    con.print(_headline(plan), highlight=False)
    peak = plan.memory.peak
    where = f", pipeline stage {peak.stage} (the peak)" if plan.knobs.layout.pipeline_size > 1 else ""
    div, unit = _unit(peak.total)
    mem = _table(f"Memory per GPU{where}; {count(plan.held(peak.params))} parameters on it", "term", unit, "assumes")
    for name, value in peak.terms.items():
        mem.add_row(name, f"{value / div:.2f}", _esc(notes.get(name, "")))
    mem.add_row("total", f"{peak.total / div:.2f}", _esc(verdict(plan)), style="bold")
    con.print(mem)
    if plan.fits is False:
        saved = memory_not_modelled(plan.knobs)
        if saved:
            con.print("Not modelled (published savings that would lower this memory): " + "; ".join(saved),
                      highlight=False)
    if len(plan.memory.stages) > 1:
        first, last = plan.memory.stages[0], plan.memory.stages[-1]
        busiest = "MoE layers" if plan.knobs.moe else "layers"
        middle = (f"; stage {plan.memory.stages[1].stage}, the middle one with the most {busiest}, "
                  f"{count(plan.memory.stages[1].params)} parameters, {plan.memory.stages[1].total / div:.2f} {unit}"
                  if len(plan.memory.stages) > 2 else "; middle stages hold less than the first")
        con.print(f"Per GPU: first stage {count(first.params)} parameters, {first.total / div:.2f} {unit}; last stage "
                  f"(p-1 = {last.stage}) {count(last.params)} parameters, {last.total / div:.2f} {unit}{middle}",
                  highlight=False)
    if plan.time is None:
        con.print(f"Step time: not predicted (no peak FLOP/s for {plan.hardware.gpu_type}; set "
                  "cluster.gpu_peak_tflops)", highlight=False)
        return
    t = plan.time
    steps = _table("Step time", "term", "s", "share", "assumes")
    for name, value in t.terms.items():
        steps.add_row(name, f"{value:.4f}", f"{value / t.total_s:.0%}", _esc(notes.get(name, "")))
    steps.add_row("total", f"{t.total_s:.4f}", "",
                  f"{t.tokens_per_s:,.0f} tokens/s, {mfu_text(plan)} ({plan.convention} FLOPs convention"
                  f"{', active parameters' if plan.arch.moe else ''})",
                  style="bold")
    con.print(steps)


def set_args(overrides: list[str]) -> str:
    """``--set A --set B`` as a shell reads it back (each value quoted where the shell would change it)."""
    import shlex

    return " ".join(f"--set {shlex.quote(o)}" for o in overrides)


def mfu_peak(result: SearchResult) -> str:
    """The peak the search's MFU column divides by, e.g. ``989 TFLOP/s bf16 dense`` ('' when nothing was timed)."""
    best = result.best
    if best is None or best.time is None:
        return ""
    return f"{best.time.peak_flops / 1e12:.0f} TFLOP/s {best.knobs.precision} dense"


def search_dict(result: SearchResult) -> dict[str, Any]:
    def cand(c) -> dict[str, Any]:
        out = {"config": result.label(c), "scheme": c.knobs.scheme.name, "memory_bytes": c.memory_bytes,
               "peak_stage": c.peak_stage,
               "overrides": result.overrides(c)}
        if c.time is not None:  # candidates that do not fit are not timed
            out.update(step_s=c.step_s, tokens_per_s=c.time.tokens_per_s, mfu=c.time.mfu, terms=c.time.terms)
            if c.time.mfu_fp8 is not None:
                out["mfu_fp8"] = c.time.mfu_fp8
        return out

    best = result.best
    out = {
        "enumerated": result.enumerated, "fitting": result.fitting, "too_big": result.too_big,
        "broke_rules": [{"config": result.label(c), "violation": str(v)} for c, v in result.broke_rules],
        "elapsed_s": result.elapsed_s, "gpu_mem_bytes": result.mem_bytes,
        "headroom_bytes": result.headroom_bytes, "headroom": result.headroom_note, "usable_bytes": result.usable_bytes,
        "mfu_peak": mfu_peak(result) or None,
        "top": [cand(c) for c in result.ranked[:result.top]],
        "next": [{**cand(c), "why": why_slower(c, best)} for c in result.ranked[result.top:]],
        "smallest_too_big": cand(result.smallest_too_big) if result.smallest_too_big else None,
    }
    if result.why_none is not None:  # nothing ranked: the constraint that emptied the search, what would admit one
        out["why_none"] = result.why_none.as_dict()
    if result.kinds:  # a search across backend kinds: each kind's best, or why it was dropped
        out["backends"] = [{"kind": k.kind, "enumerated": k.enumerated, "best": cand(k.best) if k.best else None,
                            "dropped": k.reason or None} for k in result.kinds]
    return out


def print_search(result: SearchResult, recipe_name: str, apply: list[str] | None = None) -> None:
    """The search's tables; ``apply``: the best's ``--set`` flags that change the recipe (default: all of them)."""
    con = _console()
    mem = (f"{result.usable_bytes / GB:.1f} GB ({result.mem_bytes / GB:.1f} GB less "
           f"{result.headroom_bytes / GB:.1f} GB headroom, {result.headroom_note})" if result.mem_bytes
           else "no GPU memory")
    con.print(f"{recipe_name}: {result.enumerated} configurations scored in {result.elapsed_s:.2f} s: "
              f"{result.fitting} fit in {mem}, {result.too_big} do not, {len(result.broke_rules)} of the fastest "
              f"broke recipe rules", highlight=False)
    if not result.ranked:
        con.print("nothing fits and keeps the rules", style="bold red")
        for line in result.why_none.lines() if result.why_none is not None else ():
            con.print(line, highlight=False)
    best = result.best
    table = _table(f"Top {min(result.top, len(result.ranked))} by predicted step time (global batch fixed)",
                   "#", "step s", "tokens/s", f"MFU vs {mfu_peak(result)}" if best else "MFU", "GB", "configuration")
    for i, c in enumerate(result.ranked[:result.top], 1):
        table.add_row(str(i), f"{c.step_s:.3f}", f"{c.time.tokens_per_s:,.0f}", f"{c.time.mfu:.1%}",
                      f"{c.memory_bytes / GB:.1f}", _esc(result.label(c)))
    con.print(table)
    if result.ranked[result.top:]:
        losers = _table("Why the next ones lose", "#", "step s", "GB", "configuration: reason")
        for i, c in enumerate(result.ranked[result.top:], result.top + 1):
            losers.add_row(str(i), f"{c.step_s:.3f}", f"{c.memory_bytes / GB:.1f}",
                           _esc(f"{result.label(c)}: {why_slower(c, best)}"))
        con.print(losers)
    if result.kinds:
        kinds = _table("Best of each backend kind", "backend", "step s", "tokens/s", "GB",
                       "configuration or why dropped")
        for k in result.kinds:
            b = k.best
            kinds.add_row(k.kind, *((f"{b.step_s:.3f}", f"{b.time.tokens_per_s:,.0f}", f"{b.memory_bytes / GB:.1f}",
                                     _esc(b.knobs.describe())) if b else ("-", "-", "-", _esc(f"dropped: {k.reason}"))))
        con.print(kinds)
    if result.smallest_too_big:
        s = result.smallest_too_big
        con.print(f"Pruned for memory: {result.too_big} (the leanest of them, {result.label(s)}, needs "
                  f"{s.memory_bytes / GB:.1f} GB)", highlight=False)
    for c, v in result.broke_rules[:3]:
        con.print(f"Pruned by rules: {result.label(c)}: {v}", highlight=False)
    if best:
        print(apply_text(result.overrides(best) if apply is None else apply), flush=True)


def print_calibration(report: dict[str, Any]) -> None:
    con = _console()

    def num(value, fmt):
        return "-" if value is None else format(value, fmt)

    table = _table("Predicted vs measured", "run", "steps", "step s meas.", "pred.", "pred. after fit",
                   "alloc GB meas.", "pred.", "cluster")
    for r in report["runs"]:
        meas_mem = r["measured_mem_allocated_max_bytes"]
        pred_mem = r["predicted_mem_allocated_bytes"]
        table.add_row(r["run"], str(r["steps"]), num(r["measured_step_s"], ".4f"), num(r["predicted_step_s"], ".4f"),
                      num(r["predicted_step_s_after_fit"], ".4f"), num(meas_mem and meas_mem / GB, ".2f"),
                      num(pred_mem and pred_mem / GB, ".2f"), r["cluster"])
    con.print(table)
    if not report["fitted"]:
        con.print("No efficiency fitted: runs need a GPU peak (cluster.gpu_type in the table or "
                  "cluster.gpu_peak_tflops) and measured step times longer than the modelled communication.",
                  highlight=False)
    for key, entry in report["fitted"].items():
        default = entry.get("default_efficiency", report["default_efficiency"])
        con.print(f"{key}: efficiency {entry['efficiency']:.3f} (default {default:.2f}) from "
                  f"{len(entry['runs'])} run(s)", highlight=False)
    if report["store"]:
        con.print(f"stored in {report['store']}", highlight=False)
