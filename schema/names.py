"""Names that become file names: a run id names a directory under LAZARUS_HOME/runs (and the
Temporal workflow), a node name a directory under its run's standby/. One rule each, for every
door a name comes in by (the CLI, `lazarus launch`, the workflow's input, the run directory)."""

from __future__ import annotations

import re
import reprlib
from typing import Annotated, Any

from pydantic import AfterValidator

RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
"""A run id: 1 to 100 ASCII letters, digits, '.', '_' and '-', starting with a letter or digit.
That cannot be `.`, `..`, hold a separator, or look like an option; and it fits a directory name
(255 bytes) and a Temporal workflow id (1000 bytes) with room to spare."""

NODE_NAME_LIMIT = 253
"""Longest node name: a Kubernetes node's name is a DNS subdomain of at most 253 characters."""

_SHOWN = reprlib.Repr()
_SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlist, _SHOWN.maxdict, _SHOWN.maxlevel = 60, 60, 6, 6, 3


def shown(value: Any, limit: int = 120) -> str:
    """`value` as a short one-line repr for an error message: control characters escaped, long
    strings and deep or long containers cut, at most `limit` characters in all (so a hostile input
    cannot make a huge message)."""
    text = _SHOWN.repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def check_run_id(value: Any) -> str:
    """`value` when it is a run id (RUN_ID_PATTERN); ValueError with one line saying why otherwise."""
    if not isinstance(value, str) or not RUN_ID_PATTERN.fullmatch(value):
        raise ValueError(
            f"{shown(value)} is not a run id: use 1 to 100 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return value


def check_node_name(value: Any) -> str:
    """`value` when it can name a node (and a directory): printable, no path separator, not `.`
    or `..`, at most NODE_NAME_LIMIT characters; ValueError with one line otherwise."""
    if (
        not isinstance(value, str)
        or not value
        or len(value) > NODE_NAME_LIMIT
        or value in (".", "..")
        or any(c in "/\\" or not c.isprintable() or c.isspace() for c in value)
    ):
        raise ValueError(
            f"{shown(value)} is not a node name: use up to {NODE_NAME_LIMIT} printable characters "
            "without spaces or path separators, e.g. node-1"
        )
    return value


RunId = Annotated[str, AfterValidator(check_run_id)]
"""A str field that holds a run id."""

NodeName = Annotated[str, AfterValidator(check_node_name)]
"""A str field that holds a node name."""
