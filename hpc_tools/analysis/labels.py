"""What tells the runs of an analysis apart: short labels, repeat groups and scale-free configurations.

A run is identified by its resolved recipe, less what does not change what it trains or measures (``IGNORED``: name,
seed, checkpoint/profiling/tracking settings, the cluster's accounting fields). Over the runs analysed together:

- a run's *label* names only the fields whose values differ between the runs (a sweep's axes first, in the sweep's
  order; other fields only where they tell runs apart that the shown ones do not), with short names
  (``parallel.tensor_size`` -> ``tp``), e.g. ``tp=2 pp=4``; runs whose recipes are all alike are labelled by the
  recipe name;
- runs with the same identity are *repeats* of one configuration (one ``group``): the plots draw them as one line with
  a band;
- runs whose identities differ only in scale (``SCALE``: nodes, GPUs per node, global batch, data-parallel size,
  iterations) share a ``config_key``: only such runs can form a scaling series (``analysis.scaling``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

IGNORED_PREFIXES = ("name", "description", "training.seed", "checkpoint.", "profiling.", "tracking.", "local",
                    "sweep")
CLUSTER_KEPT = ("cluster.nodes", "cluster.gpus_per_node", "cluster.gpu_type")  # the rest of cluster is accounting
SCALE = ("cluster.nodes", "cluster.gpus_per_node", "training.global_batch_size", "parallel.data_size",
         "training.train_iters")
ABBREVIATIONS = {"backend.kind": "backend", "cluster.gpu_type": "gpu", "cluster.gpus_per_node": "gpus/node",
                 "tensor_size": "tp", "pipeline_size": "pp", "virtual_pipeline_size": "vpp", "data_size": "dp",
                 "context_size": "cp", "expert_size": "ep", "micro_batch_size": "mbs", "global_batch_size": "gbs",
                 "seq_length": "seq", "num_layers": "layers", "hidden_size": "hidden",
                 "num_attention_heads": "heads", "learning_rate": "lr", "train_iters": "iters",
                 "sequence_parallel": "sp"}
MAX_KEYS = 4  # a label names at most this many fields (the report's tables carry the rest)
MAX_VALUE = 14  # characters of a value shown in a label


@dataclass(frozen=True, slots=True)
class RunLabel:
    label: str  # e.g. "tp=2 pp=4"
    group: int  # repeats of one configuration share it (0, 1, ... in order of first appearance)
    config_key: str  # equal for runs that differ in scale only


def flat(data: Any, prefix: str = "") -> dict[str, Any]:
    """A nested dict as {dotted.key: leaf value}."""
    out: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, dict) and v:
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def identity(recipe) -> dict[str, Any]:
    """The fields of a resolved recipe that make a run what it is (dotted keys, recipe order)."""
    data = flat(recipe.model_dump(mode="json", exclude={"local", "sweep"}))
    return {k: v for k, v in data.items() if not k.startswith(IGNORED_PREFIXES)
            and (not k.startswith("cluster.") or k in CLUSTER_KEPT)}


def _digest(fields: dict[str, Any]) -> str:
    return hashlib.sha1(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:12]


def short_name(key: str) -> str:
    """``parallel.tensor_size`` -> ``tp``; unknown keys by their last part."""
    return ABBREVIATIONS.get(key) or ABBREVIATIONS.get(key.rsplit(".", 1)[-1]) or key.rsplit(".", 1)[-1]


def show(value: Any) -> str:
    """A value as a label shows it: short, one line."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    text = " ".join(str(value).split())
    return text if len(text) <= MAX_VALUE else text[: MAX_VALUE - 1] + "…"


def _partition(rows: list[dict[str, Any]], keys: list[str]) -> list[str]:
    return [json.dumps([r.get(k) for k in keys], default=str) for r in rows]


def varying_keys(rows: list[dict[str, Any]], first: list[str] = ()) -> list[str]:
    """The keys whose values differ between ``rows``: the keys in ``first`` (a sweep's axes) that vary, then the other
    varying keys that tell apart runs the chosen keys do not, at most MAX_KEYS in all."""
    keys = list(dict.fromkeys([*first, *(k for r in rows for k in r)]))
    varying = [k for k in keys if len({json.dumps(r.get(k), default=str) for r in rows}) > 1]
    chosen = [k for k in varying if k in first]
    for k in varying:
        if len(chosen) >= MAX_KEYS:
            break
        if k not in chosen and len(set(_partition(rows, [*chosen, k]))) > len(set(_partition(rows, chosen))):
            chosen.append(k)
    return chosen


def describe(inputs: list) -> list[RunLabel]:
    """A label, repeat group and scale-free configuration key for each run (``inputs.RunInput``), read together."""
    rows = [identity(i.recipe) if i.recipe is not None else {"run": i.run_id} for i in inputs]
    axes = list(dict.fromkeys(k for i in inputs for k in (i.params or {})))
    keys = varying_keys(rows, axes)
    digests = [_digest(r) for r in rows]
    groups = {d: n for n, d in enumerate(dict.fromkeys(digests))}
    labels = []
    for inp, row in zip(inputs, rows):
        text = " ".join(f"{short_name(k)}={show(row.get(k))}" for k in keys)
        if not text:
            text = inp.recipe.name if inp.recipe is not None else inp.run_id[-22:]
        labels.append(text)
    # Two configurations with one label (values cut short, or more differences than MAX_KEYS): numbered apart.
    by_label: dict[str, set[int]] = {}
    for text, d in zip(labels, digests):
        by_label.setdefault(text, set()).add(groups[d])
    labels = [f"{t} #{groups[d]}" if len(by_label[t]) > 1 else t for t, d in zip(labels, digests)]
    scale_free = [_digest({k: v for k, v in r.items() if k not in SCALE}) for r in rows]
    return [RunLabel(label=t, group=groups[d], config_key=c) for t, d, c in zip(labels, digests, scale_free)]
