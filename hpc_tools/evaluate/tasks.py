"""lm-eval's task names: the harness's own and those of the YAML files under ``--include-path``, checked before any
job is rendered or model exported."""

from __future__ import annotations

import difflib
from pathlib import Path

from hpc_tools.errors import UserError


def parse_tasks(text: str) -> list[str]:
    tasks = [t.strip() for t in text.split(",") if t.strip()]
    if not tasks:
        raise UserError(f"--tasks {text!r} names no task (give lm-eval task names separated by commas, e.g. "
                        "--tasks hellaswag,arc_easy, or tasks defined under --include-path)")
    return tasks


def check_include_path(path: str | None) -> str | None:
    if path is None:
        return None
    p = Path(path).expanduser()
    if not p.is_dir():
        raise UserError(f"--include-path {path} is not a folder (give the folder that holds your lm-eval task "
                        "YAML files)")
    if not any(p.rglob("*.yaml")):
        raise UserError(f"--include-path {path} holds no .yaml task file (write lm-eval task YAMLs there: "
                        "docs/evaluate-and-quantize.md)")
    return str(p.absolute())


def check_tasks(tasks: list[str], include_path: str | None) -> None:
    """Every task (or group, or tag) known to lm-eval with ``include_path``; one line naming the first unknown."""
    local = set(local_manager(include_path).all_tasks) if include_path else set()
    if all(t in local for t in tasks):
        return
    known = local | default_task_names()
    for task in tasks:
        if task not in known:
            close = difflib.get_close_matches(task, sorted(known), n=3)
            hint = f"; close: {', '.join(close)}" if close else ""
            where = f" or under --include-path {include_path}" if include_path else ""
            raise UserError(f"--tasks: {task!r} is not an lm-eval task{where} ({len(known)} known{hint}) (name a "
                            "task of `lm_eval --tasks list`, or add its YAML under --include-path DIR)")


def task_manager(tasks: list[str], include_path: str | None):
    """The TaskManager for an evaluation: the include path's tasks only when they are all there (lm-eval's own index
    of its ~15,000 task files takes a minute on a loaded CPU), else lm-eval's too."""
    from lm_eval.tasks import TaskManager

    if include_path:
        local = local_manager(include_path)
        if all(t in local.all_tasks for t in tasks):
            return local
    return TaskManager(include_path=include_path)


def local_manager(include_path: str):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=False)


def default_task_names() -> set[str]:
    """The names lm-eval's own task files define, indexed once per lm-eval version and kept in
    ``$XDG_CACHE_HOME/hpc_tools`` (``~/.cache``): they change only with the installed version."""
    import json
    import os
    from importlib import metadata

    version = metadata.version("lm_eval")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hpc_tools" / \
        f"lm_eval-{version}-tasks.json"
    try:
        return set(json.loads(cache.read_text()))
    except (OSError, ValueError):
        pass
    from lm_eval.tasks import TaskManager

    names = sorted(TaskManager().all_tasks)
    try:
        from hpc_tools.registry import atomic_write

        cache.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(cache, json.dumps(names))
    except OSError:  # a read-only home: index again next time
        pass
    return set(names)
