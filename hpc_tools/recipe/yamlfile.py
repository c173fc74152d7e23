"""Reading a recipe file, bounded: recipe files are untrusted input (``MAX_BYTES``, UTF-8 only, ``MAX_DEPTH`` levels of
nesting, ``MAX_NODES`` values once aliases are expanded, no duplicate keys), so a hostile file is refused in
milliseconds with a one-line UserError, never a hang or a traceback (``docs/untrusted-input.md``). Used for recipes
(``recipe/load.py``) and the site file (``recipe/site.py``).
"""

from __future__ import annotations

import copy
import functools
import re
from pathlib import Path
from typing import Any

import yaml

from hpc_tools.errors import UserError
from hpc_tools.recipe.text import printable

MAX_BYTES = 64 << 10  # a resolved recipe is ~4 KiB, a sweep grid a few more; PyYAML reads ~1 MB/s


MAX_DEPTH = 32  # sections nest 4 deep; config_overrides and sweep cells a few more
MAX_NODES = 100_000  # YAML values after alias expansion (an alias bomb expands to billions)


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
    return copy.deepcopy(_parsed(data, shown))


@functools.lru_cache(maxsize=16)
def _parsed(data: bytes, shown: str) -> dict[str, Any]:
    """One parse per file content (``validate`` reads a recipe once per profile); callers get a deep copy."""
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
# YAML 1.2 booleans: only true/false (any of PyYAML's three casings) are booleans; YAML 1.1's yes/no/on/off stay the
# words written, so that a number field refusing one quotes it as written (`restarts=yes`, not `restarts=true`); a
# bool field takes them as true/false (``recipe.base.BOOL_WORDS``).
RecipeLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
RecipeLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                   list("tTfF"))

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
