"""The reference rows read from the source: the environment variables each module declares, and the
worker's Prometheus metrics (lazarus/reference/pages.py turns them into pages)."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

from prometheus_client.metrics import MetricWrapperBase

from lazarus.activities.metrics import Metrics
from lazarus.schema.run import CONTRACT_ENV

PACKAGE = Path(__file__).resolve().parents[1]

ENVIRONMENT_GROUPS = [
    (
        "The CLI and the worker",
        "Read by `lazarus` and `lazarus worker`: where Temporal is, where runs keep their state, the worker's "
        "defaults.",
        ["client/config.py"],
    ),
    (
        "Set for every rank",
        "Set by a node's launcher in every rank's environment (trainer/CONTRACT.md says what each means to a "
        "script), beside torchrun's own variables listed last. A spec's `trainer.env` may not override them.",
        ["schema/contract.py", "trainer/agent/stack_dump.py"],
    ),
    (
        "Tests only",
        "Read by the worker to stop inside a stage, so that tests can kill it there.",
        ["activities/failpoints.py"],
    ),
]
"""(heading, one line on who reads them, modules declaring `ENV_* = "NAME"` with a docstring each)."""


def declared_variables(module: Path) -> list[tuple[str, str]]:
    """(name, docstring) of each module-level `ENV_* = "NAME"` in `module`; ValueError for one without a
    docstring, which the reference could not explain."""
    body = ast.parse(module.read_text(encoding="utf-8")).body
    found = []
    for statement, following in itertools.pairwise([*body, None]):
        if not (isinstance(statement, ast.Assign) and isinstance(statement.value, ast.Constant)):
            continue
        target = statement.targets[0]
        if not (isinstance(target, ast.Name) and target.id.startswith("ENV_")):
            continue
        doc = (
            following.value.value
            if isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
            else None
        )
        if not isinstance(doc, str):
            raise ValueError(f"{module}:{statement.lineno}: {target.id} has no docstring to say what it means")
        found.append((str(statement.value.value), " ".join(doc.split())))
    return found


def environment_rows() -> list[tuple[str, str, list[list[str]]]]:
    """(heading, intro, rows of variable, meaning, module) for each group of variables."""
    groups = []
    for heading, intro, modules in ENVIRONMENT_GROUPS:
        rows = [
            [f"`{name}`", meaning, f"`{module}`"]
            for module in modules
            for name, meaning in declared_variables(PACKAGE / module)
        ]
        if heading == "Set for every rank":
            rows += [
                [f"`{name}`", "as torchrun sets it", "`schema/run.py` CONTRACT_ENV"] for name in sorted(CONTRACT_ENV)
            ]
        groups.append((heading, intro, rows))
    return groups


def metric_rows() -> list[list[str]]:
    """(metric, type, labels, meaning) of every metric the worker serves."""
    metrics = Metrics()
    rows = []
    for metric in vars(metrics).values():
        if isinstance(metric, MetricWrapperBase):
            # The public describe() drops the label names; the collector keeps them.
            labels = ", ".join(f"`{label}`" for label in metric._labelnames)
            rows.append([f"`{metric._name}`", metric._type, labels, metric._documentation])
    return sorted(rows)
