"""Read a run spec from YAML and turn every mistake into one line that names the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from lazarus.schema.names import shown
from lazarus.schema.run import RunSpec


class SpecError(ValueError):
    """A spec that cannot run; the message is one line naming the field and the fix."""


def _field_path(loc: tuple, whole: str) -> str:
    # A key the user wrote (an unknown field) may hold anything: a newline, a dot, a megabyte.
    parts = (str(p) if isinstance(p, int) or (str(p).isidentifier() and len(str(p)) <= 60) else shown(p) for p in loc)
    return ".".join(parts) or whole


def validation_message(error: ValidationError, whole: str = "spec") -> str:
    """The first problem of a pydantic error, as one line `field: what is wrong` (`whole` names
    the document itself, when the problem is its shape)."""
    first = error.errors()[0]
    message = first["msg"].removeprefix("Value error, ")
    kind = first["type"]
    path = _field_path(first["loc"], whole)
    if kind == "value_error":
        # A model's own validators start their messages with the field's path; a field's do not.
        loc = first["loc"]
        return message if not loc or message.startswith(str(loc[0])) else f"{path}: {message}"
    if kind == "extra_forbidden":
        return f"{path}: unknown field; check its spelling against the documented fields"
    if kind == "missing":
        return f"{path}: required field is missing"
    message = " ".join(message.replace("Input should be", "must be").split())
    if kind == "literal_error":
        return f"{path}: {shown(first['input'])} is not supported; {message}"
    if kind == "string_pattern_mismatch":
        return f"{path}: {shown(first['input'])} is not allowed; use lowercase letters, digits and dashes"
    return f"{path}: {message} (got {shown(first.get('input'))})"


def parse_spec(data: Any, model: type[BaseModel] = RunSpec) -> Any:
    """Validate a spec (a RunSpec, or another model) given as plain data (a dict from YAML or JSON)."""
    if not isinstance(data, dict):
        raise SpecError(f"spec: expected a mapping of fields at the top level, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise SpecError(validation_message(error)) from None


def load_spec(path: str | Path, model: type[BaseModel] = RunSpec) -> Any:
    """Read and validate a YAML run spec (or another model, such as a planner Scenario)."""
    path = Path(path)
    try:
        text = path.read_bytes().decode()
    except OSError as error:
        raise SpecError(f"{path}: cannot read the spec ({error.strerror or error})") from None
    except UnicodeDecodeError as error:
        raise SpecError(f"{path}: not a YAML text file (byte {error.start} is not UTF-8)") from None
    except ValueError as error:  # a path the system cannot even look up (a NUL in it)
        raise SpecError(f"{shown(str(path))}: cannot read the spec ({error})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise SpecError(f"{path}: not valid YAML{where}") from None
    except RecursionError:  # PyYAML builds nested collections recursively
        raise SpecError(f"{path}: nested too deeply to be a run spec") from None
    return parse_spec(data, model)
