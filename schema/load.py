"""Read a run spec from YAML and turn every mistake into one line that names the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from lazarus.schema.run import RunSpec


class SpecError(ValueError):
    """A spec that cannot run; the message is one line naming the field and the fix."""


def _field_path(loc: tuple) -> str:
    return ".".join(str(part) for part in loc) or "spec"


def _one_line(error: ValidationError) -> str:
    """The first problem of a pydantic error, as `field: what is wrong`."""
    first = error.errors()[0]
    message = first["msg"].removeprefix("Value error, ")
    kind = first["type"]
    path = _field_path(first["loc"])
    if kind == "value_error":
        # Our own validators already start with the field's path.
        return message
    if kind == "extra_forbidden":
        return f"{path}: unknown field; check its spelling against the documented fields"
    if kind == "missing":
        return f"{path}: required field is missing"
    message = message.replace("Input should be", "must be")
    if kind == "literal_error":
        return f"{path}: {first['input']!r} is not supported; {message}"
    if kind == "string_pattern_mismatch":
        return f"{path}: {first['input']!r} is not allowed; use lowercase letters, digits and dashes"
    return f"{path}: {message} (got {first.get('input')!r})"


def parse_spec(data: Any, model: type[BaseModel] = RunSpec) -> Any:
    """Validate a spec (a RunSpec, or another model) given as plain data (a dict from YAML or JSON)."""
    if not isinstance(data, dict):
        raise SpecError(f"spec: expected a mapping of fields at the top level, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise SpecError(_one_line(error)) from None


def load_spec(path: str | Path, model: type[BaseModel] = RunSpec) -> Any:
    """Read and validate a YAML run spec (or another model, such as a planner Scenario)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise SpecError(f"{path}: cannot read the spec ({error.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise SpecError(f"{path}: not valid YAML{where}") from None
    return parse_spec(data, model)
