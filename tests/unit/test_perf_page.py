"""bench/perf_page.py: a bench's page holds its header line and the rows it was given, and the index
lists every page present."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime
from pathlib import Path

from bench import perf_page


def sitting() -> perf_page.Sitting:
    return perf_page.Sitting(
        started=datetime(2026, 12, 4, 14, 55, 31, tzinfo=UTC),
        load_start=1.5,
        commit="abc1234 + uncommitted changes",
        machine="Some CPU, 2 logical cores, 8.0 GiB, Debian",
        command=".venv/bin/python bench/example.py --markdown",
    )


def write(path: Path, rows: list[list[object]], title: str = "Example") -> Path:
    table = perf_page.Table(["policy", "seconds", "ETTR"], rows, "1000 repetitions")
    return perf_page.write_page(
        path,
        sitting(),
        title=title,
        doc="How fast the example is.\n\nMore detail.",
        about="What the example measures.",
        tables=[table],
        notes=["a note"],
    )


def test_page_has_the_header_line_and_the_rows(tmp_path):
    text = write(tmp_path / "example.md", [["automatic", "4.44", "93.78%"], ["all", "19.74", None]]).read_text()
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("Measured "))
    assert header.startswith(
        "Measured 2026-12-04 14:55 UTC on Some CPU, 2 logical cores, 8.0 GiB, Debian; "
        "load average (1 min) 1.50 at start, "
    )
    assert header.endswith(
        "at end; commit abc1234 + uncommitted changes; command: `.venv/bin/python bench/example.py --markdown`"
    )
    assert "| policy | seconds | ETTR |" in lines
    assert "|---|---:|---:|" in lines
    assert "| automatic | 4.44 | 93.78% |" in lines
    assert "| all | 19.74 | - |" in lines
    assert "# Example" in lines
    assert "What the example measures." in lines
    assert "- a note" in lines
    assert perf_page.read_front_matter(tmp_path / "example.md") == {
        "title": "Example",
        "summary": "How fast the example is.",
        "measured": "2026-12-04 14:55 UTC",
    }


def test_a_page_is_overwritten_not_appended(tmp_path):
    write(tmp_path / "example.md", [["first", "1.00", "1%"]])
    text = write(tmp_path / "example.md", [["second", "2.00", "2%"]]).read_text()
    assert "| second | 2.00 | 2% |" in text
    assert "first" not in text
    assert text.count("Measured ") == 1


def test_a_cell_with_a_pipe_stays_in_its_column(tmp_path):
    text = write(tmp_path / "example.md", [["a|b", "1.00", "1%"]]).read_text()
    assert "| a\\|b | 1.00 | 1% |" in text


def test_index_lists_every_page_present(tmp_path):
    write(tmp_path / "alpha.md", [["x", "1.00", "1%"]], title="Alpha figures")
    write(tmp_path / "beta.md", [["y", "2.00", "2%"]], title="Beta figures")
    script = tmp_path / "gamma.py"
    script.write_text('"""What gamma measures, in one line."""\n\nPAGE_TITLE = "Gamma figures"\n')
    placeholder = perf_page.write_placeholder(tmp_path / "gamma.md", script).read_text()
    assert perf_page.NOT_MEASURED in placeholder
    assert ".venv/bin/python bench/gamma.py --markdown" in placeholder
    assert "Measured " not in placeholder

    index = perf_page.write_index(tmp_path).read_text().splitlines()
    assert "| [Alpha figures](alpha.md) | How fast the example is. | 2026-12-04 14:55 UTC |" in index
    assert "| [Beta figures](beta.md) | How fast the example is. | 2026-12-04 14:55 UTC |" in index
    assert "| [Gamma figures](gamma.md) | What gamma measures, in one line. | not yet measured |" in index
    assert not any("index.md" in line for line in index)
    pages = sorted(p.name for p in tmp_path.glob("*.md") if p.name != "index.md")
    assert sum(line.startswith("| [") for line in index) == len(pages) == 3


def test_markdown_option_defaults_to_the_scripts_page():
    parser = argparse.ArgumentParser()
    perf_page.add_option(parser, "/somewhere/bench/simulate.py")
    assert parser.parse_args([]).markdown is None
    assert parser.parse_args(["--markdown"]).markdown == perf_page.PAGES / "simulate.md"
    assert parser.parse_args(["--markdown", "out.md"]).markdown == Path("out.md")
