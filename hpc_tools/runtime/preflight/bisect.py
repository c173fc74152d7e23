"""Finding a slow node among N in at most ceil(log2 N) + 1 collective rounds: test halves.

A *round* is one set of collectives run at once over disjoint groups of nodes. ``find_slow`` first tests every node
together (round 1); when that group is slow (or cannot be judged alone), it splits the candidates in two halves and
tests both at once, keeps the slow half and counts the other as healthy, until one candidate is left: every round
halves the candidates, so a search ends after ceil(log2 N) + 1 rounds at most (``max_rounds``). It assumes one slow
node (or link); when both halves are slow it stops and names the candidates left.

A half of a single node has no link of its own to test: it is tested with a node already found healthy (a
*reference*) when there is one. Where there is none (three nodes or two), the round function may answer None for
it, and the search takes it as the opposite of its sibling when the candidates are known to hold a slow node; two
nodes whose pair is slow and neither of which can be tested apart are both named (a slow link cannot be pinned on
one of its two ends). The whole group's verdict may be None too (no expected figure to compare it with): the halves
are then compared with each other only, and a node that cannot be tested apart is named by nothing.

``slow`` is the cost function: given the groups of one round (tuples of node names), whether each group is slow
(None: cannot be told). The rank side (``run``) measures all-reduce bus bandwidth over each group; the unit tests
use a simulated function.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

RoundFn = Callable[[list[tuple[str, ...]]], list[bool | None]]


def max_rounds(n: int) -> int:
    """The bound: ceil(log2 n) + 1 rounds for n nodes (1 for a single node)."""
    return 1 + (math.ceil(math.log2(n)) if n > 1 else 0)


@dataclass
class Search:
    """The outcome: the nodes named (empty: none slow), the rounds spent, each round's groups and one line why."""

    culprits: tuple[str, ...]
    rounds: int
    note: str
    tested: list[list[tuple[str, ...]]] = field(default_factory=list)
    between: tuple[tuple[str, ...], tuple[str, ...]] | None = None
    """The two halves when the whole group is slow but neither half is (the slow part lies between them)."""


def find_slow(nodes: Sequence[str], slow: RoundFn, test_whole: bool = True) -> Search:
    """The slow node among ``nodes`` (module docstring); ``test_whole=False`` starts with the halves (the whole
    group's verdict already known to be slow)."""
    nodes = list(nodes)
    tested: list[list[tuple[str, ...]]] = []

    def run(groups: list[tuple[str, ...]]) -> list[bool | None]:
        tested.append(groups)
        out = list(slow(groups))
        if len(out) != len(groups):
            raise ValueError(f"the round function answered {len(out)} verdicts for {len(groups)} groups")
        return out

    whole: bool | None = True
    if test_whole and nodes:
        [whole] = run([tuple(nodes)])
        if whole is False:
            return Search((), len(tested), f"all {len(nodes)} nodes together are not slow", tested)
    candidates, good = nodes, []
    while len(candidates) > 1:
        half = (len(candidates) + 1) // 2
        first, second = candidates[:half], candidates[half:]
        refs = iter(good)
        groups = [tuple(h + ([next(refs)] if len(h) == 1 and len(good) > i else [])) for i, h in
                  enumerate((first, second))]
        s1, s2 = run(groups)
        if s1 is None and s2 is None:
            if whole is None:  # nothing says the pair is slow: nothing to pin
                return Search((), len(tested), f"{' and '.join(candidates)} cannot be tested apart and nothing "
                              "says they are slow together", tested)
            return Search(tuple(candidates), len(tested), f"{' and '.join(candidates)} together are slow and "
                          "neither can be tested apart (a slow link cannot be pinned on one of its two ends)", tested)
        # one lone node untested: the opposite of its sibling when the candidates are known to hold a slow node
        s1 = (not s2 and whole is True) if s1 is None else s1
        s2 = (not s1 and whole is True) if s2 is None else s2
        if s1 and s2:
            return Search(tuple(candidates), len(tested), "both halves are slow: more than one slow node", tested)
        if not s1 and not s2:
            note = ("no half is slower than the other" if whole is None else
                    "the whole group is slow but neither half is: the slow part lies between the halves "
                    f"({', '.join(first)} | {', '.join(second)})")
            return Search((), len(tested), note, tested, None if whole is None else (tuple(first), tuple(second)))
        candidates, good = (first, good + second) if s1 else (second, good + first)
        whole = True  # the candidates left hold the slow node
    note = f"{candidates[0]} is slow" if candidates else "no nodes"
    return Search(tuple(candidates), len(tested), note, tested)
