"""The docs site's reference pages are what the code generates, and the code gives them something to say:
every spec field, record field, CLI argument and environment variable has its description."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel, Field

from lazarus.reference import pages as reference
from lazarus.reference.models import (
    OPERATOR_MESSAGES,
    RUN_DIRECTORY_RECORDS,
    nested_models,
    run_directory_paths,
    undocumented,
)
from lazarus.reference.sources import declared_variables, metric_rows
from lazarus.schema.run import RunSpec

ROOT = Path(__file__).resolve().parents[2]
PAGES = ROOT / "docs" / "reference"
CODE_FOLDERS = ["lazarus", "schema", "infra", "activities", "workflows", "trainer"]


def test_the_committed_reference_is_what_the_code_generates():
    assert reference.stale(PAGES) == [], "run: .venv/bin/python -m lazarus.reference"


def test_every_spec_field_record_field_and_operator_message_field_has_a_description():
    models = [*nested_models(RunSpec), *OPERATOR_MESSAGES, *RUN_DIRECTORY_RECORDS]
    assert len(models) > 25
    assert undocumented(models) == []


def test_a_field_without_a_description_is_named():
    class Example(BaseModel):
        told: int = Field(default=1, description="Said (units).")
        untold: int = 2

    assert undocumented([Example]) == ["Example.untold"]


def test_every_spec_field_appears_in_the_spec_page():
    page = (PAGES / "spec.md").read_text()
    for model in nested_models(RunSpec):
        section = page.split(f"## {model.__name__}\n", 1)[1].split("\n## ", 1)[0]
        for name in model.model_fields:
            assert f"| `{name}` |" in section, f"{model.__name__}.{name}"


def test_every_command_and_argument_has_help_and_appears_in_the_cli_page():
    page = (PAGES / "cli.md").read_text()
    parsers = reference._cli_parsers()
    assert {"lazarus run start", "lazarus worker", "lazarus launch", "lazarus pool add"} <= {n for n, _, _ in parsers}
    for name, parser, text in parsers:
        assert text or parser.description, f"{name} has no help"
        section = page.split(f"## `{name}`\n", 1)[1].split("\n## ", 1)[0]
        for action in reference.parser_actions(parser):
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"
            for flag in action.option_strings or [action.metavar or action.dest]:
                assert f"`{flag}`" in section, f"{name} {flag}"


def test_every_environment_variable_the_code_names_is_in_the_environment_page():
    page = (PAGES / "environment.md").read_text()
    named = set()
    for folder in CODE_FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            named |= set(re.findall(r"\bLAZARUS_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    assert len(named) > 20
    missing = sorted(name for name in named if f"`{name}`" not in page)
    assert missing == []


def test_a_variable_without_a_docstring_is_refused(tmp_path):
    module = tmp_path / "settings.py"
    module.write_text('ENV_TOLD = "LAZARUS_TOLD"\n"""What it means."""\nENV_UNTOLD = "LAZARUS_UNTOLD"\n')
    with pytest.raises(ValueError, match="ENV_UNTOLD has no docstring"):
        declared_variables(module)
    module.write_text('ENV_TOLD = "LAZARUS_TOLD"\n"""What it means."""\n')
    assert declared_variables(module) == [("LAZARUS_TOLD", "What it means.")]


def test_every_metric_and_run_directory_path_says_what_it_is():
    rows = metric_rows()
    assert {row[0] for row in rows} >= {"`lazarus_stage_seconds`", "`lazarus_incidents`", "`lazarus_lost_steps`"}
    assert all(row[3] for row in rows)
    paths = run_directory_paths()
    assert "`runs/RUN/incarnations/K/heartbeat/R.json`" in [row[0] for row in paths]
    assert [row[1] for row in paths if not row[2]] == []


def test_check_names_a_stale_page(tmp_path, capsys):
    assert reference.main([str(tmp_path)]) == 0
    assert reference.main(["--check", str(tmp_path)]) == 0
    (tmp_path / "metrics.md").write_text("edited by hand\n")
    assert reference.main(["--check", str(tmp_path)]) == 1
    assert "metrics.md: stale" in capsys.readouterr().err
