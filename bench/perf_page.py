"""The bench scripts' pages for the docs site: docs/performance/<script>.md, the latest measurement
only (earlier ones are in git's history), and docs/performance/index.md listing them.

    .venv/bin/python bench/perf_page.py --index          # rewrite the index from the pages present
    .venv/bin/python bench/perf_page.py --placeholders   # a "not yet measured" page for each script without one

A bench takes `begin()` as it starts and `write_page(...)` at its end, with the figures it printed;
every page written into docs/performance/ rewrites the index too.
"""

from __future__ import annotations

import argparse
import ast
import os
import platform
import re
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
PAGES = ROOT / "docs" / "performance"
INDEX = "index.md"
NOT_MEASURED = "Not yet measured with this script's --markdown"
# Scripts not run as `.venv/bin/python bench/<name>.py`: the command a placeholder page gives.
RUN_COMMANDS = {
    "elastic_train": ".venv/bin/torchrun --standalone --nproc-per-node 4 bench/elastic_train.py "
    "--steps 300 --step-log /tmp/elastic_train.jsonl --checkpoint-dir /tmp/elastic_train.checkpoints --markdown",
}
_NUMBER = re.compile(r"^[-+]?[\d,]*\.?\d+(e[-+]?\d+)?\s*(%|x|s|ms|MB|B)?$")


@dataclass
class Table:
    """One table of a page: its column headers and rows (cells as the bench printed them)."""

    headers: Sequence[str]
    rows: Sequence[Sequence[object]]
    caption: str = ""


@dataclass
class Sitting:
    """The run that measured a page, as it stood when the bench started."""

    started: datetime
    load_start: float
    commit: str
    machine: str
    command: str
    load_end: float | None = None


def add_option(parser: argparse.ArgumentParser, script: str) -> None:
    """--markdown [PATH] on a bench's parser, PATH docs/performance/<script's name>.md by default."""
    name = Path(script).stem
    parser.add_argument(
        "--markdown",
        nargs="?",
        const=PAGES / f"{name}.md",
        type=Path,
        metavar="PATH",
        help=f"also write the figures as a Markdown page, overwritten (default PATH: docs/performance/{name}.md)",
    )


def load_average() -> float:
    return os.getloadavg()[0]


def machine() -> str:
    """CPU model, logical cores, memory and OS of this machine, in one phrase."""
    cpu = platform.processor() or platform.machine() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = "unknown memory"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory = f"{int(line.split()[1]) / 2**20:.1f} GiB"
                break
    except (OSError, ValueError, IndexError):
        pass
    system = f"{platform.system()} {platform.release()}"
    try:
        release = dict(line.split("=", 1) for line in Path("/etc/os-release").read_text().splitlines() if "=" in line)
        system = f"{release['PRETTY_NAME'].strip(chr(34))}, {system}"
    except (OSError, KeyError):
        pass
    # A container may be limited to fewer cores than the machine has: the ones this process may use.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cpu}, {cores} logical cores, {memory}, {system}"


def git_commit(root: Path = ROOT) -> str:
    """The short commit, with "+ uncommitted changes" when the tree differs from it."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        # The pages themselves aside: a bench rewriting them must not call its own tree dirty.
        dirty = git("status", "--porcelain", "--", ".", ":(exclude)docs/performance")
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"
    return f"{commit} + uncommitted changes" if dirty else commit


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command as typed: the interpreter relative to the working folder where it lies below it."""
    if argv is None:
        python = sys.executable
        relative = os.path.relpath(python)
        argv = [python if relative.startswith("..") else relative, *sys.argv]
    return shlex.join(argv)


def begin(command: Sequence[str] | None = None) -> Sitting:
    """Take what the page says of the run, as the bench starts."""
    return Sitting(
        started=datetime.now(UTC),
        load_start=load_average(),
        commit=git_commit(),
        machine=machine(),
        command=command_line(command),
    )


def summary_of(doc: str | None) -> str:
    """A docstring's first paragraph, on one line."""
    return " ".join((doc or "").strip().split("\n\n")[0].split())


def _cell(value: object) -> str:
    text = "-" if value is None else str(value)
    return " ".join(text.replace("|", "\\|").split())


def render_table(table: Table) -> str:
    """A Markdown table; columns whose every cell is a number are right-aligned."""
    cells = [[_cell(v) for v in row] for row in table.rows]
    numeric = [
        bool(cells) and all(_NUMBER.match(row[i]) or row[i] == "-" for row in cells) for i in range(len(table.headers))
    ]
    lines = [
        "| " + " | ".join(_cell(h) for h in table.headers) + " |",
        "|" + "|".join("---:" if n else "---" for n in numeric) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines)


def _front_matter(data: dict) -> str:
    return "---\n" + yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=1000) + "---\n"


def header_line(sitting: Sitting) -> str:
    end = "unknown" if sitting.load_end is None else f"{sitting.load_end:.2f}"
    return (
        f"Measured {sitting.started:%Y-%m-%d %H:%M} UTC on {sitting.machine}; "
        f"load average (1 min) {sitting.load_start:.2f} at start, {end} at end; "
        f"commit {sitting.commit}; command: `{sitting.command}`"
    )


def render_page(
    sitting: Sitting, title: str, summary: str, about: str, tables: Sequence[Table], notes: Sequence[str] = ()
) -> str:
    measured = {"title": title, "summary": summary, "measured": f"{sitting.started:%Y-%m-%d %H:%M} UTC"}
    parts = [
        _front_matter(measured)
        + "<!-- Written by the command below with --markdown; rerun it rather than edit this page. -->",
        f"# {title}",
        header_line(sitting),
        " ".join(about.split()),
    ]
    for table in tables:
        if table.caption:
            parts.append(f"**{' '.join(table.caption.split())}**")
        parts.append(render_table(table))
    if notes:
        parts.append("\n".join(f"- {' '.join(note.split())}" for note in notes))
    return "\n\n".join(parts) + "\n"


def write_page(
    path: Path,
    sitting: Sitting,
    *,
    title: str,
    doc: str | None,
    about: str,
    tables: Sequence[Table],
    notes: Sequence[str] = (),
) -> Path:
    """Write (overwrite) the page; when it lands among the docs' pages, rewrite their index too.

    `doc` is the bench's docstring: its first paragraph is the page's line in the index."""
    sitting.load_end = load_average()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_page(sitting, title, summary_of(doc), about, tables, notes))
    if path.resolve().parent == PAGES.resolve():
        write_index(PAGES)
    print(f"wrote {path}", file=sys.stderr)
    return path


def read_front_matter(path: Path) -> dict:
    text = path.read_text()
    if not text.startswith("---\n"):
        return {}
    end = text.find("\n---\n", 4)
    if end < 0:
        return {}
    data = yaml.safe_load(text[4:end])
    return data if isinstance(data, dict) else {}


def write_index(folder: Path = PAGES) -> Path:
    """The index of every page in `folder`: its title, what it measures, when it was measured."""
    rows = []
    for page in sorted(p for p in folder.glob("*.md") if p.name != INDEX):
        meta = read_front_matter(page)
        title = meta.get("title") or page.stem
        rows.append([f"[{title}]({page.name})", meta.get("summary", ""), meta.get("measured") or "not yet measured"])
    table = render_table(Table(["page", "what it measures", "measured"], rows))
    text = "\n\n".join(
        [
            _front_matter({"title": "Performance"})
            + "<!-- Written by `.venv/bin/python bench/perf_page.py --index` (and by every bench's --markdown). -->",
            "# Performance",
            "One page per script in `bench/`, written by the script itself when run with `--markdown`: the "
            "figures it printed, with the machine, its load, the commit and the command line. A page holds "
            "the latest measurement only; earlier ones are in the git history of `docs/performance/`. "
            "Timings move with how busy the machine was: each page gives its load average at the start and "
            "the end of the run.",
            table,
        ]
    )
    path = folder / INDEX
    path.write_text(text + "\n")
    return path


def run_command(name: str) -> str:
    return RUN_COMMANDS.get(name, f".venv/bin/python bench/{name}.py --markdown")


def page_title(module: ast.Module, default: str) -> str:
    """The script's PAGE_TITLE, read without importing it (its imports may need what is not here)."""
    for node in module.body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "PAGE_TITLE" for t in node.targets)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            return node.value.value
    return default


def write_placeholder(path: Path, script: Path) -> Path:
    """A page for a script not yet run with --markdown: it says so and how to run it, nothing more."""
    name = script.stem
    module = ast.parse(script.read_text())
    title = page_title(module, name)
    text = "\n\n".join(
        [
            _front_matter({"title": title, "summary": summary_of(ast.get_docstring(module)), "measured": None})
            + f"# {title}",
            f"{NOT_MEASURED}. To measure:",
            f"```bash\n{run_command(name)}\n```",
        ]
    )
    path.write_text(text + "\n")
    return path


def scripts() -> list[Path]:
    """The bench scripts, this module aside."""
    return sorted(p for p in BENCH.glob("*.py") if p.name != Path(__file__).name and not p.name.startswith("_"))


def main() -> None:
    parser = argparse.ArgumentParser(description=summary_of(__doc__))
    parser.add_argument("--index", action="store_true", help="rewrite docs/performance/index.md")
    parser.add_argument(
        "--placeholders", action="store_true", help="write a not-yet-measured page for each script without a page"
    )
    args = parser.parse_args()
    if not (args.index or args.placeholders):
        parser.error("give --index, --placeholders or both")
    PAGES.mkdir(parents=True, exist_ok=True)
    if args.placeholders:
        for script in scripts():
            page = PAGES / f"{script.stem}.md"
            if not page.exists():
                print(f"wrote {write_placeholder(page, script)}", file=sys.stderr)
    print(f"wrote {write_index(PAGES)}", file=sys.stderr)


if __name__ == "__main__":
    main()
