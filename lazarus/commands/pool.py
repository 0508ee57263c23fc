"""`lazarus pool [list|add|return|domain|breaker]`: the node pool of the local, simulated and Slurm
backends, kept in the store (LAZARUS_STORE, by default SQLite in LAZARUS_HOME) and shared by every
run of it (and by every worker that serves them).

A run takes its active nodes from the pool at launch and claims free nodes as spares when it
loses one; what a fault quarantined stays out of every run until it is returned here (or with
`lazarus run return-node`). On Kubernetes the pool is the nodes labelled `lazarus.dev/pool`, and
kubectl manages them. On Slurm the pool names the cluster's nodes: a node a Slurm run quarantined
is drained in Slurm too, and returning it resumes it there.

A node may belong to a fault domain (a rack, a switch: nodes that fail together), and the pool's
quarantine breaker caps how many nodes faults may quarantine within a window: past it nothing more
is quarantined, the runs that would need it pause, and a person resets it here.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator

from lazarus.client.config import Settings
from lazarus.commands.common import (
    UserError,
    connect_client,
    node_name,
    open_cluster,
    positive_int,
    registered_backend,
)


def register(commands: argparse._SubParsersAction) -> None:
    """Add `pool` and its actions to the top-level commands."""
    pool = commands.add_parser(
        "pool", help="the local nodes every run of LAZARUS_HOME shares: list them, add nodes, return repaired ones"
    )
    pool.add_argument("--json", action="store_true", help="print the pool's record as JSON")
    pool.set_defaults(handler=list_pool)
    actions = pool.add_subparsers(dest="pool_command", metavar="ACTION")
    listing = actions.add_parser("list", help="every node with its role, owner and health (the default)")
    listing.add_argument("--json", action="store_true", help="print the pool's record as JSON")
    listing.set_defaults(handler=list_pool)
    add = actions.add_parser("add", help="add COUNT free healthy nodes (hot spares for every run)")
    add.add_argument("count", metavar="COUNT", type=positive_int, help="how many nodes to add")
    add.set_defaults(handler=add_nodes)
    back = actions.add_parser(
        "return",
        help="a repaired node rejoins the pool as a free spare; a run that quarantined it and still runs is told",
    )
    back.add_argument("node", metavar="NODE", type=node_name, help="the repaired node, e.g. node-2")
    back.set_defaults(handler=return_node)
    domain = actions.add_parser(
        "domain", help="place nodes in a fault domain (a rack, a switch: nodes that fail together)"
    )
    domain.add_argument("domain", metavar="DOMAIN", help="the domain's name, e.g. rack-2; '-' takes them out of any")
    domain.add_argument(
        "nodes", metavar="NODE", nargs="+", type=node_name, help="nodes of the pool, e.g. node-0 node-4"
    )
    domain.set_defaults(handler=place_nodes)
    breaker = actions.add_parser(
        "breaker",
        help="show the quarantine breaker, change its cap or window, or reset it once it tripped",
        description="Faults may quarantine at most --max-fraction of the pool's nodes within --window-seconds. "
        "A quarantine past that trips the breaker: nothing more is quarantined, and each run that would need it "
        "stops its ranks and pauses with the reason, until a person resets the breaker (then `lazarus run resume`). "
        "An operator's own `lazarus run drain-node` is neither counted nor refused.",
    )
    breaker.add_argument("--max-fraction", type=float, help="share of the pool's nodes, 0 < F <= 1 (default 0.5)")
    breaker.add_argument("--window-seconds", type=float, help="the sliding window, in seconds (default 300)")
    breaker.add_argument("--reset", action="store_true", help="close the breaker; its window starts empty")
    breaker.set_defaults(handler=set_breaker)


@contextlib.contextmanager
def _pool(settings: Settings) -> Iterator:
    """The pool of the settings' store (NodePool) for the length of a command; a store that cannot be
    opened or answers with an error is one line (UserError)."""
    from lazarus.infra.pool import open_pool
    from lazarus.infra.pool_import import import_old_pool
    from lazarus.infra.store import StoreError, StoreURLError, default_url, open_store

    try:
        store = open_store(settings.store or default_url(settings.home))
    except (StoreError, StoreURLError) as error:
        raise UserError(str(error)) from None
    try:
        import_old_pool(store, settings.home)
        yield open_pool(store, settings.runs_folder.parent)
    except StoreError as error:
        raise UserError(str(error)) from None
    finally:
        store.close()


def list_pool(args: argparse.Namespace, settings: Settings) -> int:
    """Print every node of the pool: role, owner, health, since when, and why."""
    from lazarus.console import stdout, stdout_reserved_for_json, table

    with _pool(settings) as pool:
        record, where = pool.read(), pool.store.url
    if args.json:
        with stdout_reserved_for_json() as emit:
            emit(record.model_dump(mode="json"))
        return 0
    if not record.nodes:
        print(f"the pool of {where} has no node yet: a run's launch adds what it needs")
        return 0
    grid = table("NODE", "ROLE", "RUN", "HEALTH", "DOMAIN", "SINCE", "NOTE")
    for node in record.nodes:
        health = "ok" if node.healthy else f"dead since {node.died_at:%H:%M:%S}" if node.died_at else "dead"
        since = f"{node.since:%Y-%m-%d %H:%M:%S}"
        grid.add_row(node.name, node.role, node.owner or "", health, node.domain or "", since, node.note)
    stdout.print(grid)
    free = len(record.free())
    print(f"{len(record.nodes)} node(s), {free} free hot spare(s) in {where}")
    print(_breaker_line(record))
    return 0


def _breaker_line(record) -> str:
    """The quarantine breaker in one line, with the command that resets it once it tripped."""
    from datetime import UTC, datetime

    line = f"quarantine breaker {record.breaker.describe(len(record.nodes), datetime.now(UTC), record.out())}"
    return line + ("; reset it with `lazarus pool breaker --reset`" if record.breaker.tripped_at else "")


def place_nodes(args: argparse.Namespace, settings: Settings) -> int:
    """Place nodes of the pool in a fault domain."""
    from lazarus.infra.backend import ClusterError

    domain = None if args.domain == "-" else args.domain
    try:
        with _pool(settings) as pool:
            pool.set_domain(args.nodes, domain)
    except ClusterError as error:
        raise UserError(str(error)) from None
    print(f"{', '.join(args.nodes)} {'in fault domain ' + domain if domain else 'in no fault domain'}")
    return 0


def set_breaker(args: argparse.Namespace, settings: Settings) -> int:
    """Show the quarantine breaker; change its cap or window; reset it."""
    from pydantic import ValidationError

    with _pool(settings) as pool:
        try:
            if args.max_fraction is not None or args.window_seconds is not None:
                pool.set_breaker(args.max_fraction, args.window_seconds)
        except ValidationError as error:
            problem = error.errors()[0]
            raise UserError(f"--{str(problem['loc'][0]).replace('_', '-')}: {problem['msg']}") from None
        if args.reset:
            pool.reset_breaker()
        print(_breaker_line(pool.read()))
    return 0


def add_nodes(args: argparse.Namespace, settings: Settings) -> int:
    """Add free healthy nodes to the pool."""
    with _pool(settings) as pool:
        names = pool.add(args.count, "added by `lazarus pool add`")
        where = pool.store.url
    print(f"added {', '.join(names)}: free hot spares of every run of {where}")
    return 0


async def return_node(args: argparse.Namespace, settings: Settings) -> int:
    """Return a repaired node: through the run that quarantined it while that run's workflow runs
    (so its status shows the node back), else straight to the pool (a Slurm run's node is resumed
    in Slurm first)."""
    from lazarus.infra.backend import ClusterError

    with _pool(settings) as pool:
        node = pool.node(args.node)
        where = pool.store.url
    if node is None:
        raise UserError(f"the pool of {where} has no node {args.node} (`lazarus pool` lists them)")
    quarantined_by = node.owner if node.role == "quarantined" else None
    if quarantined_by and await _told_the_run(quarantined_by, node.name, settings):
        print(f"{node.name} is a free spare again (returned through run {quarantined_by})")
        return 0
    try:
        backend = _backend_of(settings, quarantined_by) if quarantined_by else None
        if quarantined_by and backend and registered_backend(backend).quarantines_in_cluster:
            # The run that marked it in its cluster (drained in Slurm) has ended: it is returned
            # there, then freed here.
            open_cluster(backend, settings).return_node(quarantined_by, node.name)
            print(f"{node.name} is a free spare again (returned in its {backend} cluster)")
            return 0
        with _pool(settings) as pool:
            pool.return_node(node.name)
    except ClusterError as error:
        raise UserError(str(error)) from None
    print(f"{node.name} is a free spare again")
    return 0


def _backend_of(settings: Settings, run_id: str) -> str | None:
    """The cluster backend of a run of LAZARUS_HOME, from its spec; None when it has none to read."""
    from lazarus.schema.run import RunSpec
    from lazarus.schema.rundir import RunDir

    spec_file = RunDir(settings.runs_folder / run_id).spec_file
    try:
        return RunSpec.model_validate_json(spec_file.read_text()).cluster.backend
    except (OSError, ValueError):
        return None


async def _told_the_run(run_id: str, node: str, settings: Settings) -> bool:
    """Ask the run that quarantined `node` to return it (its return_node update); False when the
    run's workflow no longer runs, or no server answers (the pool is then changed directly)."""
    from temporalio.client import WorkflowExecutionStatus, WorkflowUpdateFailedError
    from temporalio.service import RPCError

    from lazarus.schema.controls import ReturnNodeRequest
    from lazarus.workflows.training_run import TrainingRun

    try:
        client = await connect_client(settings)
    except UserError as error:
        print(f"note: run {run_id} is not told ({error})", file=sys.stderr, flush=True)
        return False
    handle = client.get_workflow_handle(run_id)
    try:
        if (await handle.describe()).status != WorkflowExecutionStatus.RUNNING:
            return False
        await handle.execute_update(TrainingRun.return_node, ReturnNodeRequest(node=node))
    except WorkflowUpdateFailedError as error:
        raise UserError(f"run {run_id} refused to return {node}: {getattr(error.cause, 'message', error)}") from None
    except RPCError:
        return False  # no such workflow on this server: the run is not live here
    return True
