"""Node names and rank numbers in a compact form, so that what a run of thousands of nodes records
(assignments, inventories, decisions, the ranks a drain stopped) stays small in Temporal's
payloads and history.

A long list is written the way Slurm writes host lists: `node-[0-2047]` for node-0 .. node-2047.
Unlike Slurm's, the form keeps the list's order (an assignment's order is its rank order), so
`node-[0-2,2048,4-2047]` is node-3 replaced by node-2048. Numbers written with leading zeros keep
their width (`gpu-[0007-0010]`). A list shorter than COMPACT_FROM is written as a plain list, so
small runs record exactly what they always did; both forms are read everywhere.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import operator
import re
from typing import Annotated

from pydantic import BeforeValidator, PlainSerializer, WrapSerializer

COMPACT_FROM = 64
"""Lists of at least this many names are written in the compact form (names)."""

MAX_NAMES = 1_000_000
"""Most names a compact list may stand for: a few characters must not expand into gigabytes."""

_DIGITS = "0123456789"
_GROUP = re.compile(r"([^\[\],]*)\[([0-9,\-]+)\]|([^\[\],]+)")
_SPECIAL = re.compile(r"[\[\],]")


def natural_key(name: str) -> list:
    """A sort key that orders the numbers in names as numbers: node-2 before node-10."""
    # ASCII digits only: str.isdigit takes "²" too, which int() refuses.
    return [
        (0, int(part), "") if part.isascii() and part.isdigit() else (1, 0, part)
        for part in re.split(r"([0-9]+)", name)
    ]


def _width(digits: str) -> int:
    """The width a number keeps: its length when written with leading zeros, else 0 (any)."""
    return len(digits) if len(digits) > 1 and digits[0] == "0" else 0


def _number(value: int, width: int) -> str:
    return str(value).zfill(width)


def compress(names: list[str]) -> str:
    """The compact form of `names`, in their order; ValueError for a name it cannot hold
    (an empty one, or one with '[', ']' or ',')."""
    return _compress(tuple(names))


@functools.lru_cache(maxsize=256)
def _compress(names: tuple[str, ...]) -> str:
    # Cached: a workflow writes the same assignment in several payloads (the incident, the next
    # stage's input, the status), and a 2,048-name list takes milliseconds to compress.
    parts: list[str] = []
    prefix, width, spans = None, 0, []  # the group being built: its prefix, number width, [first, last] spans

    def close() -> None:
        if prefix is not None:
            text = ",".join(
                _number(a, width) if a == b else f"{_number(a, width)}-{_number(b, width)}" for a, b in spans
            )
            parts.append(f"{prefix}[{text}]")

    for name in names:
        if not name or "[" in name or "]" in name or "," in name:
            raise ValueError(f"node name {name!r} cannot be written compactly")
        head = name.rstrip(_DIGITS)
        digits = name[len(head) :]
        value = int(digits) if digits and digits.isascii() else None
        if value is None or _number(value, _width(digits)) != digits:
            close()
            prefix, spans = None, []
            parts.append(name)  # no number, or none that gives it back (e.g. "00")
            continue
        if head == prefix and _width(digits) == width:
            if spans[-1][1] + 1 == value:
                spans[-1][1] = value
            else:
                spans.append([value, value])
            continue
        close()
        prefix, width, spans = head, _width(digits), [[value, value]]
    close()
    return ",".join(parts)


def expand(text: str) -> list[str]:
    """The names a compact form stands for, in order; ValueError for text that is not one."""
    return list(_expand(text))


@functools.lru_cache(maxsize=256)
def _expand(text: str) -> tuple[str, ...]:
    # Cached as _compress is: every stage's input and result carries the assignment, and a list
    # of 2,048 names that 470 replacements broke into ranges takes milliseconds to expand.
    names: list[str] = []
    position = 0
    while position < len(text):
        group = _GROUP.match(text, position)
        if group is None:
            raise ValueError(f"not a node list at character {position}: {text[position : position + 40]!r}")
        if group[3] is not None:
            names.append(group[3])
        else:
            prefix = group[1]
            for span in group[2].split(","):
                first, dash, last = span.partition("-")
                if not first or (dash and not last) or "-" in last or int(last or first) < int(first):
                    raise ValueError(f"bad range {span!r} in node list {text[:60]!r}")
                width = _width(first)
                if len(names) + int(last or first) - int(first) >= MAX_NAMES:
                    raise ValueError(f"node list {text[:60]!r} names more than {MAX_NAMES:,} nodes")
                numbers = map(str, range(int(first), int(last or first) + 1))
                names.extend(map(prefix.__add__, numbers if not width else (n.zfill(width) for n in numbers)))
        position = group.end()
        if position < len(text):
            if text[position] != ",":
                raise ValueError(f"expected ',' at character {position} of node list {text[:60]!r}")
            position += 1
    return tuple(names)


def _read(value):
    return expand(value) if isinstance(value, str) else value


def _written(names: list[str]) -> list[str] | str:
    if len(names) < COMPACT_FROM:
        return names
    try:
        return compress(names)
    except ValueError:
        return names


NodeList = Annotated[list[str], BeforeValidator(_read), PlainSerializer(_written, when_used="json")]
"""A list of node names: a list in Python, written compactly in JSON once it is long (COMPACT_FROM)."""


def compress_numbers(numbers: list[int]) -> str:
    """`numbers` as ranges in their order: [0, 1, 2, 5, 7, 8] -> "0-2,5,7-8"."""
    increasing = all(map(operator.lt, numbers, itertools.islice(numbers, 1, None)))
    if numbers and (lowest := numbers[0] if increasing else min(numbers)) < 0:
        raise ValueError(f"rank {lowest} cannot be written compactly")
    if increasing:
        spans = _increasing_spans(numbers)
    else:
        spans = []
        for value in numbers:
            if spans and spans[-1][1] + 1 == value:
                spans[-1][1] = value
            else:
                spans.append([value, value])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _increasing_spans(numbers: list[int]) -> list[list[int]]:
    """The ranges of a strictly increasing list, found by bisection: within a range, a number
    less its index is constant, and across the list it never decreases. A drain's 16,384 ranks
    with one node's missing are two bisections, not 16,384 steps of a loop."""
    spans, start, count = [], 0, len(numbers)
    indexes = range(count)
    while start < count:
        offset = numbers[start] - start
        end = bisect.bisect_right(indexes, offset, lo=start, key=lambda i: numbers[i] - i)
        spans.append([numbers[start], numbers[end - 1]])
        start = end
    return spans


def expand_numbers(text: str) -> list[int]:
    """The numbers a compact form stands for, in order; ValueError for text that is not one."""
    if not text:
        return []
    numbers: list[int] = []
    for span in text.split(","):
        first, dash, last = span.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()) or int(last or first) < int(first):
            raise ValueError(f"bad range {span!r} in {text[:60]!r}")
        if len(numbers) + int(last or first) - int(first) >= MAX_NAMES:
            raise ValueError(f"{text[:60]!r} stands for more than {MAX_NAMES:,} numbers")
        numbers.extend(range(int(first), int(last or first) + 1))
    return numbers


def _read_numbers(value):
    return expand_numbers(value) if isinstance(value, str) else value


def _written_numbers(numbers: list[int]) -> list[int] | str:
    return numbers if len(numbers) < COMPACT_FROM else compress_numbers(numbers)


RankList = Annotated[list[int], BeforeValidator(_read_numbers), PlainSerializer(_written_numbers, when_used="json")]
"""A list of ranks: a list in Python, written as ranges in JSON once it is long (COMPACT_FROM)."""


def _read_rank_steps(value):
    """{rank: step}, from either form: {"rank": step} or, compact, {"step": "ranks"}."""
    if isinstance(value, dict) and value and all(isinstance(v, str) for v in value.values()):
        return {rank: int(step) for step, ranks in value.items() for rank in expand_numbers(ranks)}
    return value


def _written_rank_steps(steps: dict[int, int]) -> dict:
    if len(steps) < COMPACT_FROM:
        return steps
    ranks = sorted(steps)
    values = list(map(steps.__getitem__, ranks))
    distinct = sorted(set(values))
    if len(distinct) <= 8:
        # A drain's survivors hold one step or two (a replica a step ahead): a pass per step in C
        # rather than a Python loop over 16,384 ranks.
        return {
            str(step): compress_numbers(list(itertools.compress(ranks, map(step.__eq__, values)))) for step in distinct
        }
    by_step: dict[int, list[int]] = {}
    for rank, step in zip(ranks, values, strict=True):
        by_step.setdefault(step, []).append(rank)
    return {str(step): compress_numbers(by_step[step]) for step in distinct}


RankSteps = Annotated[
    dict[int, int], BeforeValidator(_read_rank_steps), PlainSerializer(_written_rank_steps, when_used="json")
]
"""Rank -> a step: a dict in Python, written in JSON as step -> its ranks (ranges) once it is long."""


def _read_node_groups(value):
    """Records from either form: one dict per node, or, compact, one per run of alike nodes with
    their `names` (a compact node list)."""
    if not isinstance(value, list) or not any(isinstance(item, dict) and "names" in item for item in value):
        return value
    records = []
    for item in value:
        if isinstance(item, dict) and "names" in item:
            alike = {key: field for key, field in item.items() if key != "names"}
            records.extend({"name": name, **alike} for name in expand(item["names"]))
        else:
            records.append(item)
    return records


def _written_node_groups(records, handler):
    data = handler(records)
    if len(data) < COMPACT_FROM or any(_SPECIAL.search(item["name"]) for item in data):
        return data
    groups: list[tuple[dict, list[str]]] = []  # (what the nodes share, their names)
    for item in data:
        name = item.pop("name")  # the handler's dicts are this call's own: what is left is alike
        if groups and groups[-1][0] == item:
            groups[-1][1].append(name)
        else:
            groups.append((item, [name]))
    return [{"names": compress(names), **alike} for alike, names in groups]


NodeGroups = [BeforeValidator(_read_node_groups), WrapSerializer(_written_node_groups, when_used="json")]
"""Annotations for a list of per-node records with a `name`: once long, JSON holds one record per
run of neighbours alike in everything but the name (Annotated[list[Model], *NodeGroups])."""
