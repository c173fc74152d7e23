"""The units of what the operator reads, chosen once: the rank log's progress line, ``status``, ``plan``,
``analyze`` and the report all format their quantities here, so one quantity reads the same everywhere.

- Memory: GB = 1e9 bytes (the planner's unit, as in the ZeRO paper; an "80GB" H100 holds 85.9 GB). Never GiB.
- Throughput: tokens/s with a k/M/G suffix (``1.74k``), per GPU beside it.
- Shares (MFU, goodput, pipeline wait): percent with one decimal (``40.7 %``), never a bare fraction.
- Durations: seconds per step with 3 decimals; elapsed time and ETA as ``h:mm:ss``.
"""

from __future__ import annotations

import math

GB = 1e9


def _missing(x) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def gb(nbytes: float | None, digits: int = 2) -> str:
    """``0.39 GB`` (``-`` when unknown)."""
    return "-" if _missing(nbytes) else f"{nbytes / GB:.{digits}f} GB"


def rate(x: float | None) -> str:
    """A rate with a k/M/G suffix, three significant digits: ``1.74k`` (``-`` when unknown)."""
    if _missing(x):
        return "-"
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def pct(share: float | None, digits: int = 1) -> str:
    """A share as percent: ``40.7 %`` (``-`` when unknown)."""
    return "-" if _missing(share) else f"{100 * share:.{digits}f} %"


def seconds_per_step(s: float | None) -> str:
    return "-" if _missing(s) else f"{s:.3f} s/step"


def hms(seconds: float | None) -> str:
    """``h:mm:ss`` (``-`` when unknown)."""
    if _missing(seconds) or seconds < 0:
        return "-"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def sci(x: float | None) -> str:
    """A learning rate or gradient norm: ``3.00e-04``, ``1.25`` (``-`` when unknown)."""
    if _missing(x):
        return "-"
    return f"{x:.2e}" if x != 0 and not 1e-2 <= abs(x) < 1e4 else f"{x:.3g}"


# Column name -> how a table cell shows it (the tables of analyze and the report; ``cell``).
_PERCENT = ("mfu", "hfu", "goodput", "efficiency", "efficiency_lo", "efficiency_hi", "spread", "rank_skew",
            "all_to_all_share")


def cell(column: str, value) -> str:
    """A table cell of figure ``column``: shares, MFU and goodput in percent, rates with a suffix, seconds with 3-4
    decimals, memory in GB, the rest as they are; ``-`` for a missing value."""
    if _missing(value):
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if column in _PERCENT or column.endswith("_share") or column.endswith("_share_theory"):
        return pct(value)
    if column.startswith("tokens_per_s"):
        return rate(value)
    if column.endswith("_gb"):
        return f"{value:.2f}"
    if column.endswith("_bytes"):
        return gb(value)
    if column.endswith("_s") and isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 10 else f"{value:.1f}"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
