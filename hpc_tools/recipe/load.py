"""Reading a recipe: YAML -> overrides -> typed model -> rule check.

Precedence, lowest to highest (the one place it is decided):
    1. defaults declared on the section models,
    2. the site file (``hpc_tools.recipe.site``: $HPC_TOOLS_SITE or ~/.config/hpc_tools/site.yaml), merged under every
       recipe file ``read_yaml`` reads (a run folder's resolved recipe is complete and never gets it again),
    3. the recipe file,
    4. its `local:` profile, when the job runs locally or with `--profile local`,
    5. `--set section.key=value` overrides from the command line, in the order given.
Mappings merge key by key (a site's `cluster.setup.env` and a recipe's add up); lists and values replace.

Recipe files are untrusted input: reading one is bounded (``MAX_BYTES``, UTF-8 only, ``MAX_DEPTH`` levels of
nesting, ``MAX_NODES`` values once aliases are expanded, no duplicate keys), so a hostile file is refused in
milliseconds with a one-line UserError, never a hang or a traceback. Values are then bounded by the schema
(``hpc_tools.recipe.base.Section``).
"""

from __future__ import annotations

import copy
import difflib
from pathlib import Path
from typing import Any, Iterable

import yaml
from pydantic import ValidationError

from hpc_tools.errors import RecipeError, UserError, Violation
from hpc_tools.recipe.base import printable
from hpc_tools.recipe.fields import field_at, schema_path, valid_keys
from hpc_tools.recipe.schema import Recipe

PROFILES = ("local",)


MAX_BYTES = 64 << 10  # a resolved recipe is ~4 KiB, a sweep grid a few more; PyYAML reads ~1 MB/s
MAX_DEPTH = 32  # sections nest 4 deep; config_overrides and sweep cells a few more
MAX_NODES = 100_000  # YAML values after alias expansion (an alias bomb expands to billions)


def read_yaml(path: str | Path, site: bool = True) -> dict[str, Any]:
    """The recipe file as a mapping, over the site file's defaults unless ``site`` is False; a missing, unreadable,
    oversized, non-UTF-8 file or bad YAML is a one-line UserError (a bad site file too, naming it)."""
    raw = read_recipe_file(path)
    if not site:
        return raw
    from hpc_tools.recipe.site import read_site

    _, defaults = read_site()
    return deep_merge(defaults, raw) if defaults else raw


def read_recipe_file(path: str | Path) -> dict[str, Any]:
    """The recipe file alone as a mapping (no site defaults)."""
    path = Path(path)
    shown = printable(str(path))
    if not path.exists():
        raise UserError(f"recipe {shown} does not exist (give the path of a recipes/*.yaml file)")
    if not path.is_file():
        raise UserError(f"recipe {shown} is not a regular file (give the path of a recipes/*.yaml file)")
    try:
        with path.open("rb") as fh:
            data = fh.read(MAX_BYTES + 1)
    except OSError as exc:
        raise UserError(f"recipe {shown} cannot be read: {exc.strerror or exc} (check its permissions)") from None
    return parse_yaml(decode(data, shown), shown)


def decode(data: bytes, source: str = "recipe") -> str:
    """Recipe bytes as text: UTF-8 (a UTF-8 byte-order mark is dropped), at most MAX_BYTES, no NUL bytes."""
    if len(data) > MAX_BYTES:
        raise UserError(f"{source} is larger than {MAX_BYTES >> 10} KiB, not a recipe (give a recipes/*.yaml file)")
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise UserError(f"{source} is UTF-16 text (save it as UTF-8)")
    if b"\0" in data:
        raise UserError(f"{source} holds NUL bytes: a binary file, not a YAML recipe (give a recipes/*.yaml file)")
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        raise UserError(f"{source} is not UTF-8 text (byte {data[exc.start]:#04x} at offset {exc.start}; "
                        "save it as UTF-8)") from None


class RecipeLimitError(yaml.composer.ComposerError):
    """Well-formed YAML that a recipe refuses (too deep, too many values, a duplicate key, an absurd integer)."""


class RecipeLoader(yaml.SafeLoader):
    """PyYAML's safe loader with bounds: nesting depth, values after alias expansion, duplicate keys refused."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        # The composer recurses once per level: refuse deep nesting before Python's recursion limit does.
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise RecipeLimitError(None, None, f"nesting deeper than {MAX_DEPTH} levels",
                                       self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: set = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *base` then overriding keys is YAML's own way to extend a mapping
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                    seen.add(key)
                except TypeError:  # an unhashable key: the base class reports it
                    continue
                if duplicate:
                    raise RecipeLimitError(
                        None, None, f"duplicate key {printable(str(key))!r} (the first one would be silently "
                        "ignored; keep one)", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node):
        # Python refuses int() of more than 4300 digits with a ValueError; a recipe has no use for more than 64 bits
        digits = sum(ch.isdigit() for ch in str(node.value))
        if digits > 40:
            raise RecipeLimitError(None, None, f"an integer of {digits} digits, beyond 64 bits", node.start_mark)
        return super().construct_yaml_int(node)


RecipeLoader.add_constructor("tag:yaml.org,2002:int", RecipeLoader.construct_yaml_int)


def expanded_size(node: yaml.Node, limit: int = MAX_NODES) -> int:
    """Values in the YAML tree once aliases are expanded, counted without expanding them (memoised per node);
    stops counting past ``limit``."""
    sizes: dict[int, int] = {}

    def size(n: yaml.Node) -> int:
        if id(n) in sizes:
            return sizes[id(n)]
        total = 1
        if isinstance(n, yaml.SequenceNode):
            children = n.value
        elif isinstance(n, yaml.MappingNode):
            children = [x for pair in n.value for x in pair]
        else:
            children = []
        for child in children:
            total += size(child)
            if total > limit:
                break
        sizes[id(n)] = total
        return total

    return size(node)


def flow_depth_check(text: str) -> None:
    """Refuse deeply nested flow collections (``[[[[...``) before PyYAML scans them: its scanner keeps a possible
    simple key per open bracket and rescans them all for each token (quadratic: seconds for 5,000 brackets). Counted
    without regard to quotes, so it can only over-count brackets inside quoted text, and only past MAX_DEPTH."""
    depth = line = 0
    for line, text_line in enumerate(text.split("\n")):
        for ch in text_line:
            if ch in "[{":
                depth += 1
                if depth > MAX_DEPTH:
                    raise RecipeLimitError(None, None, f"nesting deeper than {MAX_DEPTH} levels",
                                           yaml.Mark("recipe", 0, line, 0, None, None))
            elif ch in "]}" and depth:
                depth -= 1


def safe_yaml(text: str) -> Any:
    """``yaml.safe_load`` with RecipeLoader's bounds; raises yaml.YAMLError (with a mark where it can)."""
    flow_depth_check(text)
    loader = RecipeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if expanded_size(node) > MAX_NODES:
            raise RecipeLimitError(None, None, f"more than {MAX_NODES} values once aliases are expanded "
                                   "(an alias bomb?)", node.start_mark)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def parse_yaml(text: str, source: str = "recipe") -> dict[str, Any]:
    """A recipe's text as a mapping (bounded: see RecipeLoader); bad YAML is a one-line UserError."""
    try:
        raw = safe_yaml(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = printable(getattr(exc, "problem", None) or str(exc).splitlines()[0])
        if isinstance(exc, RecipeLimitError):
            raise UserError(f"{source}:{where} is refused: it holds {problem} (no recipe needs that; fix it there)") \
                from None
        raise UserError(f"{source}:{where} is not valid YAML: {problem} (fix the syntax there)") from None
    if not isinstance(raw, dict):
        raise UserError(f"{source} must be a YAML mapping with sections name, model, parallel, ... "
                        f"(got {type(raw).__name__})")
    return raw


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """A new dict: ``top`` over ``base``, merging nested mappings key by key."""
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def parse_override(text: str) -> tuple[list[str], Any]:
    """``parallel.tensor_size=4`` -> (['parallel', 'tensor_size'], 4); the value is read as YAML."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip() or any(not part for part in key.strip().split(".")):
        raise UserError(f"--set {printable(text)[:80]!r} must look like section.key=value "
                        "(e.g. --set parallel.tensor_size=4)")
    try:
        parsed = safe_yaml(value) if value.strip() else ""
    except RecipeLimitError as exc:  # YAML, but not a value a recipe takes
        raise UserError(f"--set {printable(key.strip())[:80]}=...: the value holds {exc.problem} "
                        "(give a plain value)") from None
    except yaml.YAMLError:
        parsed = value  # not YAML: the text itself
    return key.strip().split("."), parsed


def apply_overrides(raw: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    out = copy.deepcopy(raw)
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for depth, part in enumerate(path[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                where = printable(".".join(path[: depth + 1]))
                raise UserError(f"--set {printable(text)[:80]!r}: {where} is a value, not a section "
                                f"(set {where}=... instead)")
            node = child
        node[path[-1]] = value
    return out


def apply_profile(raw: dict[str, Any], profile: str | None) -> dict[str, Any]:
    if profile is None:
        return raw
    if profile not in PROFILES:
        raise UserError(f"--profile {profile} is unknown (valid: {', '.join(PROFILES)})")
    merged = {k: v for k, v in raw.items() if k != profile}
    block = raw.get(profile)
    if block is None:
        return merged
    if not isinstance(block, dict):
        raise UserError(f"{profile}: must be a mapping of recipe sections (got {type(block).__name__})")
    return deep_merge(merged, block)


def build(raw: dict[str, Any], source: str = "recipe") -> Recipe:
    """The typed recipe, or a RecipeError listing every schema violation."""
    try:
        return Recipe.model_validate(raw)
    except ValidationError as exc:
        raise RecipeError([violation_from_pydantic(err, raw) for err in exc.errors()], source) from None


def load_recipe(path: str | Path, overrides: Iterable[str] = (), profile: str | None = None,
                check: bool = True) -> Recipe:
    """Read, merge and type a recipe; with ``check`` also enforce the cross-field rules (hpc_tools.recipe.rules)."""
    raw = read_yaml(path)
    return resolve(raw, overrides, profile, printable(str(path)), check)


def resolve(raw: dict[str, Any], overrides: Iterable[str] = (), profile: str | None = None,
            source: str = "recipe", check: bool = True) -> Recipe:
    merged = apply_overrides(apply_profile(raw, profile), overrides)
    if profile is not None:
        merged.pop("local", None)
    recipe = build(merged, source)
    if check:
        from hpc_tools.recipe.rules import check_recipe

        violations = check_recipe(recipe)
        if violations:
            raise RecipeError(violations, source)
    return recipe


def dump_resolved(recipe: Recipe) -> str:
    """The recipe as it will run: every default explicit, no profile, no sweep."""
    data = recipe.model_dump(mode="json", exclude={"local", "sweep"})
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=120)


# --- pydantic errors -> one-line violations ---------------------------------------------------------------------------

def violation_from_pydantic(err: dict[str, Any], raw: dict[str, Any]) -> Violation:
    """One pydantic error as a one-line Violation (unknown keys get the nearest valid key)."""
    loc = [printable(str(x))[:80] for x in err["loc"] if not str(x).startswith("function-")]
    path = ".".join(loc) or "recipe"
    kind = err["type"]
    err = {**err, "input": _shown_input(err.get("input"))}
    if kind == "extra_forbidden":
        keys = valid_keys(loc[:-1])
        near = difflib.get_close_matches(loc[-1], keys, n=1, cutoff=0.5)
        hint = f"did you mean {near[0]!r}? " if near else ""
        return Violation(path, err.get("input"), "is not a known key", f"{hint}valid keys: {', '.join(keys)}")
    if kind == "missing":
        doc = _field_doc(loc)
        return Violation(path, Ellipsis, "is required", f"add it{': ' + doc if doc else ''}")
    message = err["msg"].removeprefix("Value error, ")
    if kind == "value_error" and " -- " in message:
        rule_text, fix = message.split(" -- ", 1)
        return Violation(path, err.get("input"), rule_text, fix)
    if kind.startswith("literal_error"):
        expected = err.get("ctx", {}).get("expected", "")
        return Violation(path, err.get("input"), "is not one of the allowed values", f"use one of {expected}")
    return Violation(path, err.get("input"), _lower_first(message), _fix_for(kind, path))


def _shown_input(value: Any, limit: int = 120) -> Any:
    """The offending value as an error message shows it: long strings and containers cut to ``limit`` characters
    (a hostile recipe's megabyte-long value stays a one-line error)."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit // 2]}...({len(value)} characters)"
    if isinstance(value, (list, dict, tuple)):
        text = repr(value) if len(value) < 1000 else f"<{type(value).__name__} of {len(value)} items>"
        return value if len(text) <= limit else f"{text[:limit // 2]}...({len(text)} characters)"
    return value


def _fix_for(kind: str, path: str) -> str:
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        return "choose a value in range"
    if kind.endswith("_parsing") or kind.endswith("_type"):
        noun = {"int": "an integer", "float": "a number", "bool": "true or false", "string": "a string",
                "list": "a list", "dict": "a mapping", "model": "a mapping"}.get(kind.split("_")[0], kind.split("_")[0])
        return f"give {noun}"
    return f"see `python -m hpc_tools validate --explain {schema_path(path)}`"


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]


def _field_doc(loc: list[str]) -> str:
    info = field_at(loc)
    return (info.description or "").split("\n")[0] if info else ""
