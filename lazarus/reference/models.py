"""The reference pages drawn from pydantic models: the run spec, the operator's messages, and the
run directory's paths and records (lazarus/reference/pages.py writes them)."""

from __future__ import annotations

import inspect
import json
import types
import typing
from collections.abc import Callable
from pathlib import Path

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from lazarus.schema import contract, controls, node_reports, ownership, records, stacks
from lazarus.schema.run import RunSpec
from lazarus.schema.rundir import RunDir

Table = Callable[[list[str], list[list[str]]], str]

OPERATOR_MESSAGES: list[type[BaseModel]] = [
    controls.FaultSignal,
    controls.PauseRequest,
    controls.ResumeRequest,
    controls.AbortRequest,
    controls.DrainNodeRequest,
    controls.ReturnNodeRequest,
    controls.ReshardRequest,
    controls.ApproveRequest,
    controls.SetPolicyRequest,
    controls.OperatorAnswer,
]
"""The inputs of the workflow's signal and updates, and the updates' answer (workflows/controls.py)."""

RUN_DIRECTORY_RECORDS: list[type[BaseModel]] = [
    contract.LaunchRecord,
    contract.Heartbeat,
    contract.RankExit,
    contract.MetricsLine,
    contract.SurvivorManifest,
    contract.SurvivorSource,
    node_reports.NodeReport,
    contract.RankObservation,
    stacks.StackRequest,
    records.Assignment,
    ownership.Ownership,
]
"""The typed records of the run directory, each with one writer and one reader (schema/contract.py)."""

_CONSTRAINTS = {
    annotated_types.Ge: ("≥", "ge"),
    annotated_types.Gt: (">", "gt"),
    annotated_types.Le: ("≤", "le"),
    annotated_types.Lt: ("<", "lt"),
    annotated_types.MinLen: ("at least", "min_length"),
    annotated_types.MaxLen: ("at most", "max_length"),
}


def type_name(annotation: object) -> str:
    """A field's type as a reader of YAML would say it; a model links to its own section."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(f"`{json.dumps(value)}`" for value in args)
    if origin in (typing.Union, types.UnionType):
        named = [type_name(a) for a in args if a is not type(None)]
        return " | ".join(named) + (" or null" if type(None) in args else "")
    if origin in (list, tuple, set, frozenset):
        return f"list of {type_name(args[0])}" if args else "list"
    if origin is dict:
        return f"map of {type_name(args[0])} to {type_name(args[1])}" if args else "map"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        # A spec model (a record's Layout) is described on the spec page; any other on the page at hand.
        page = "spec.md" if annotation in nested_models(RunSpec) else ""
        return f"[{annotation.__name__}]({page}#{annotation.__name__.lower()})"
    return getattr(annotation, "__name__", str(annotation))


def default_text(field: FieldInfo) -> str:
    """A field's default as it would be written in YAML; empty for a required field."""
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True, validated_data={})
    if isinstance(value, BaseModel):
        return "see its section"
    return f"`{json.dumps(value, default=str)}`"


def constraints_text(field: FieldInfo) -> str:
    """The bounds pydantic enforces on a field (≥ 0, at least 1 item, ...)."""
    shown = []
    for item in field.metadata:
        for kind, (word, attribute) in _CONSTRAINTS.items():
            if isinstance(item, kind):
                shown.append(f"{word} {getattr(item, attribute)}")
    return ", ".join(shown)


def nested_models(model: type[BaseModel]) -> list[type[BaseModel]]:
    """`model` and every model its fields hold, depth first, each once."""
    found: list[type[BaseModel]] = []

    def visit(m: type[BaseModel]) -> None:
        if m in found:
            return
        found.append(m)
        # The hints, not field.annotation: pydantic may hold a model defined further down as a forward
        # reference until something validates the model, so the order would depend on what ran before.
        hints = typing.get_type_hints(m)
        for name, field in m.model_fields.items():
            for inner in _models_in(hints.get(name, field.annotation)):
                visit(inner)

    visit(model)
    return found


def _models_in(annotation: object) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def undocumented(models: list[type[BaseModel]]) -> list[str]:
    """Fields without a description, as Model.field: a reference row would say nothing."""
    return [f"{m.__name__}.{name}" for m in models for name, f in m.model_fields.items() if not f.description]


def model_section(model: type[BaseModel], table: Table, level: str = "##") -> str:
    """A model's heading, docstring and one row per field."""
    # The hints resolve what pydantic may keep as a forward reference (a model defined further down).
    hints = typing.get_type_hints(model)
    rows = [
        [
            f"`{name}`",
            type_name(hints.get(name, f.annotation)),
            default_text(f),
            constraints_text(f),
            f.description or "",
        ]
        for name, f in model.model_fields.items()
    ]
    doc = inspect.cleandoc(model.__doc__ or "")
    return f"{level} {model.__name__}\n\n{doc}\n\n" + table(["field", "type", "default", "bounds", "meaning"], rows)


def model_pages(table: Table, generated: str) -> dict[str, str]:
    """reference/spec.md: the run spec's models, then the operator's messages."""
    parts = [
        generated,
        "# Run spec\n\n",
        "A run is started from a YAML (or JSON) file holding a `RunSpec`. Unknown fields are refused, "
        "so a misspelt field is an error, not a silent default. Units are in each field's meaning.\n\n",
    ]
    parts += [model_section(m, table) + "\n" for m in nested_models(RunSpec)]
    parts.append(
        "# Operator messages\n\nThe `report_fault` signal and the updates of a `TrainingRun` workflow take "
        "these inputs (`lazarus run ...` sends them; so can the Temporal client with the pydantic data "
        "converter).\n\n"
    )
    parts += [model_section(m, table) + "\n" for m in OPERATOR_MESSAGES]
    return {"spec.md": "".join(parts)}


def _placeholder(parameter: inspect.Parameter) -> object:
    return {"k": "K", "rank": "R", "node_index": "N", "node": "NODE"}.get(parameter.name, parameter.name.upper())


def run_directory_paths() -> list[list[str]]:
    """Every path RunDir names, relative to LAZARUS_HOME, with what it holds."""
    run = RunDir(Path("runs/RUN"))  # relative to LAZARUS_HOME, where the pool's record lies too
    rows = []
    for name, member in inspect.getmembers(RunDir):
        if name.startswith("_") or not (inspect.isfunction(member) or isinstance(member, property)):
            continue
        getter = member.fget if isinstance(member, property) else member
        if getter is None:
            continue
        parameters = list(inspect.signature(getter).parameters.values())[1:]
        if typing.get_type_hints(getter).get("return") is not Path:
            continue
        path = getattr(run, name) if isinstance(member, property) else member(run, *map(_placeholder, parameters))
        doc = inspect.cleandoc(getter.__doc__ or "")
        rows.append([f"`{path}`", f"`{name}`", doc])
    return sorted(rows)


def records_page(table: Table, generated: str) -> str:
    """reference/run-directory.md: the run directory's layout and its typed records."""
    parts = [
        generated,
        "# Run directory\n\n",
        "Each run keeps its state in `runs/RUN/` under `LAZARUS_HOME` (paths below are relative to it): the "
        "controller and the ranks meet there (trainer/CONTRACT.md says who writes and who reads each file). "
        "`K` is the incarnation, `R` the global rank, `N` the node's index in the incarnation.\n\n",
        table(["path", "RunDir", "what it holds"], run_directory_paths()),
        "\n# Records\n\n",
    ]
    spec_models = nested_models(RunSpec)
    held = [m for record in RUN_DIRECTORY_RECORDS for m in nested_models(record) if m not in spec_models]
    parts += [model_section(m, table, "##") + "\n" for m in dict.fromkeys(held)]
    return "".join(parts)
