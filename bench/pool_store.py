"""What the pool's operations cost in the store as the pool grows: a claim, its release, a run's view
and a look's question, on SQLite and PostgreSQL, at each pool size.

    .venv/bin/python bench/pool_store.py [--nodes 600,6000,60000] [--engines sqlite,postgresql]
                                         [--claims 200] [--json] [--markdown [PATH]]

For each engine and size, a fresh store (a SQLite file in a temporary folder; a database of a
PostgreSQL server the bench starts on 127.0.0.1 with fsync on, infra/harness/postgres.py) gets that
many nodes, four fifths of them active in runs of four nodes and the rest free spares, as a fleet's
pool stands. Then, --claims times, one of those runs loses a node and, each timed alone:
  claim      NodePool.claim: its new assignment takes a free spare in place of the lost node (one
             transaction: the nodes locked and changed, the want placed, the claim recorded)
  release    NodePool.release: the run ends, its nodes go back to the pool
  inventory  NodePool.inventory with the run's allowance: what reschedule reads
  dead nodes NodePool.unhealthy of the run's nodes: what every look of the run asks
Printed: the median and 99th percentile of each, in milliseconds, per engine and pool size, and the
largest pool's median claim as a multiple of the smallest's (flat: close to 1). --json prints one
document: engine -> pool size -> figure (claim_ms_median, claim_ms_p99, release_ms_median, ...).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/ is not an installed package

from bench import perf_page
from lazarus.infra.harness import postgres
from lazarus.infra.pool import NodePool
from lazarus.infra.store import open_store
from lazarus.schema.layout import Layout
from lazarus.schema.records import Assignment

PAGE_TITLE = "The pool's operations as the pool grows"
ABOUT = """Each engine and pool size is a fresh store: that many nodes, four fifths active in runs of
four nodes, the rest free spares. A run loses a node; its claim of a spare, its release at its end,
its view of the pool (reschedule's read) and a look's question (which of its nodes are dead) are each
timed alone, in milliseconds: median and 99th percentile over the claims. SQLite is a file in WAL mode
(synchronous=NORMAL); PostgreSQL a server the bench starts on 127.0.0.1 with fsync on. A claim's cost
is flat when the largest pool's median is close to the smallest's."""
RUN_NODES = 4
FIGURES = ("claim", "release", "inventory", "dead_nodes")


def fill(pool: NodePool, nodes: int) -> list[str]:
    """`nodes` nodes, four fifths active in runs of four (fleet-0, fleet-1, ...); returns the runs."""
    pool.add(nodes, "bench")
    runs = (nodes * 4 // 5) // RUN_NODES
    with pool.store.write() as tx:
        tx.run(
            "UPDATE pool_nodes SET role = 'active', owner = 'fleet-' || (seq / ?), note = 'bench' WHERE seq < ?",
            (RUN_NODES, runs * RUN_NODES),
        )
    return [f"fleet-{i}" for i in range(runs)]


def measure(pool: NodePool, runs: list[str], claims: int) -> dict[str, list[float]]:
    """Time each operation once per claim (ms), on runs spread over the pool."""
    timed: dict[str, list[float]] = {name: [] for name in FIGURES}
    layout = Layout(dp=RUN_NODES)
    spares = pool.free_spares()
    step = max(1, len(runs) // claims)
    for index in range(claims):
        run_id = runs[(index * step) % len(runs)]
        held = pool.held(run_id)
        lost, spare = held[0], spares[index % len(spares)]
        pool.set_health({lost: {"healthy": False, "died_at": datetime.now(UTC), "note": "bench"}})
        pool.quarantine(run_id, [lost], "bench", counted=False)
        assignment = Assignment(incarnation=index + 1, nodes=[spare, *held[1:]], layout=layout, master_port=1)
        for name, operation in (
            ("dead_nodes", partial(pool.unhealthy, held)),
            ("inventory", partial(pool.inventory, run_id, allowance=RUN_NODES + 1)),
            ("claim", partial(pool.claim, run_id, assignment)),
            ("release", partial(pool.release, run_id)),
        ):
            started = time.perf_counter()
            operation()
            timed[name].append((time.perf_counter() - started) * 1000)
        # The run holds its first nodes again, its lost node back, and the spare is free: as before.
        pool.return_node(lost)
        with pool.store.write() as tx:
            tx.run(
                "UPDATE pool_nodes SET role = 'active', owner = ? WHERE name IN (?, ?, ?, ?)",
                (run_id, lost, *held[1:]),
            )
    return timed


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def figures(timed: dict[str, list[float]]) -> dict[str, float]:
    result = {}
    for name, values in timed.items():
        result[f"{name}_ms_median"] = round(statistics.median(values), 3)
        result[f"{name}_ms_p99"] = round(percentile(values, 99), 3)
    return result


def sitting(engine: str, sizes: list[int], claims: int, server: postgres.PostgresServer | None, say) -> dict:
    results = {}
    for size in sizes:
        with tempfile.TemporaryDirectory() as folder:
            if engine == "sqlite":
                url = f"sqlite:///{Path(folder, 'lazarus.db').as_posix().lstrip('/')}"
            else:
                assert server is not None
                url = fresh_database(server, f"pool_{size}")
            store = open_store(url)
            try:
                pool = NodePool(store)
                started = time.monotonic()
                runs = fill(pool, size)
                say(f"{engine}: {size} nodes, {len(runs)} runs, filled in {time.monotonic() - started:.1f} s")
                results[str(size)] = figures(measure(pool, runs, claims))
            finally:
                store.close()
        say(f"{engine} {size}: {results[str(size)]}")
    return results


def fresh_database(server: postgres.PostgresServer, name: str) -> str:
    """A new database of the bench's server; its URL."""
    import psycopg

    with psycopg.connect(server.url, autocommit=True) as connection:
        connection.execute(f"DROP DATABASE IF EXISTS {name}")
        connection.execute(f"CREATE DATABASE {name}")
    return server.url.rsplit("/", 1)[0] + f"/{name}"


def table(engine: str, results: dict) -> perf_page.Table:
    sizes = list(results)
    rows = []
    for name in FIGURES:
        rows.append(
            [name, *(f"{results[s][f'{name}_ms_median']:.3f} / {results[s][f'{name}_ms_p99']:.3f}" for s in sizes)]
        )
    flat = results[sizes[-1]]["claim_ms_median"] / results[sizes[0]]["claim_ms_median"]
    caption = (
        f"{engine}: median / p99 (ms) by pool size; the {sizes[-1]}-node pool's median claim is {flat:.2f}x "
        f"the {sizes[0]}-node pool's"
    )
    return perf_page.Table(["operation", *(f"{s} nodes" for s in sizes)], rows, caption)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--nodes", default="600,6000,60000", help="pool sizes, comma-separated (default 600,6000,60000)"
    )
    parser.add_argument("--engines", default="sqlite,postgresql", help="engines, comma-separated (default both)")
    parser.add_argument("--claims", type=int, default=200, help="claims timed per engine and size (default 200)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON document")
    perf_page.add_option(parser, __file__)
    args = parser.parse_args()
    try:
        sizes = [int(size) for size in args.nodes.split(",")]
    except ValueError:
        parser.error(f"--nodes {args.nodes!r}: pool sizes as whole numbers, comma-separated")
    engines = args.engines.split(",")
    if set(engines) - {"sqlite", "postgresql"} or not engines:
        parser.error(f"--engines {args.engines!r}: sqlite, postgresql or both")
    if any(size < 10 for size in sizes) or args.claims < 1:
        parser.error("each pool size must be at least 10 nodes, and --claims at least 1")
    page = perf_page.begin()
    started = time.monotonic()

    def say(message: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {message}", file=sys.stderr, flush=True)

    results = {}
    server = None
    with tempfile.TemporaryDirectory() as folder:
        if "postgresql" in engines:
            why = postgres.why_not_startable()
            if why is not None:
                sys.exit(f"pool_store: {why}")
            server = postgres.PostgresServer(Path(folder) / "postgres")
            server.start()
        try:
            for engine in engines:
                results[engine] = sitting(engine, sizes, args.claims, server, say)
        finally:
            if server is not None:
                server.stop()
    tables = [table(engine, result) for engine, result in results.items()]
    if args.markdown:
        perf_page.write_page(args.markdown, page, title=PAGE_TITLE, doc=__doc__, about=ABOUT, tables=tables)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for shown in tables:
        print(f"\n{shown.caption}")
        print("  " + " ".join(f"{h:>22}" for h in shown.headers))
        for row in shown.rows:
            print("  " + " ".join(f"{cell:>22}" for cell in row))


if __name__ == "__main__":
    main()
