"""`lazarus pool [list|add|return]`: the local backend's node pool, shared by every run of LAZARUS_HOME.

A run takes its active nodes from the pool at launch and claims free nodes as spares when it
loses one; what a fault quarantined stays out of every run until it is returned here (or with
`lazarus run return-node`). On Kubernetes the pool is the nodes labelled `lazarus.dev/pool`, and
kubectl manages them. On Slurm the pool names the cluster's nodes: a node a Slurm run quarantined
is drained in Slurm too, and returning it resumes it there.
"""

from __future__ import annotations

import argparse
import sys

from lazarus.commands.common import UserError, connect_client, node_name, positive_int, slurm_cluster
from lazarus.config import Settings


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


def list_pool(args: argparse.Namespace, settings: Settings) -> int:
    """Print every node of the pool: role, owner, health, since when, and why."""
    from lazarus.console import stdout, stdout_reserved_for_json, table
    from lazarus.infra.pool import LocalPool

    record = LocalPool(settings.home).read()
    if args.json:
        with stdout_reserved_for_json() as emit:
            emit(record.model_dump(mode="json"))
        return 0
    if not record.nodes:
        print(f"the pool under {settings.home} has no node yet: a run's launch adds what it needs")
        return 0
    grid = table("NODE", "ROLE", "RUN", "HEALTH", "SINCE", "NOTE")
    for node in record.nodes:
        health = "ok" if node.healthy else f"dead since {node.died_at:%H:%M:%S}" if node.died_at else "dead"
        since = f"{node.since:%Y-%m-%d %H:%M:%S}"
        grid.add_row(node.name, node.role, node.owner or "", health, since, node.note)
    stdout.print(grid)
    free = len(record.free())
    print(f"{len(record.nodes)} node(s), {free} free hot spare(s); pool generation {record.generation}")
    return 0


def add_nodes(args: argparse.Namespace, settings: Settings) -> int:
    """Add free healthy nodes to the pool."""
    from lazarus.infra.pool import LocalPool

    names = LocalPool(settings.home).add(args.count, "added by `lazarus pool add`")
    print(f"added {', '.join(names)}: free hot spares of every run under {settings.home}")
    return 0


async def return_node(args: argparse.Namespace, settings: Settings) -> int:
    """Return a repaired node: through the run that quarantined it while that run's workflow runs
    (so its status shows the node back), else straight to the pool (a Slurm run's node is resumed
    in Slurm first)."""
    from lazarus.infra.backend import ClusterError
    from lazarus.infra.pool import LocalPool

    pool = LocalPool(settings.home)
    node = pool.read().node(args.node)
    if node is None:
        raise UserError(f"the pool under {settings.home} has no node {args.node} (`lazarus pool` lists them)")
    quarantined_by = node.owner if node.role == "quarantined" else None
    if quarantined_by and await _told_the_run(quarantined_by, node.name, settings):
        print(f"{node.name} is a free spare again (returned through run {quarantined_by})")
        return 0
    try:
        if quarantined_by and _backend_of(settings, quarantined_by) == "slurm":
            # The run that drained it in Slurm has ended: it is resumed there, then freed here.
            slurm_cluster(settings).return_node(quarantined_by, node.name)
            print(f"{node.name} is a free spare again (resumed in Slurm)")
            return 0
        pool.return_node(node.name)
    except ClusterError as error:
        raise UserError(str(error)) from None
    print(f"{node.name} is a free spare again")
    return 0


def _backend_of(settings: Settings, run_id: str) -> str | None:
    """The cluster backend of a run of LAZARUS_HOME, from its spec; None when it has none to read."""
    from lazarus.schema.run import RunSpec
    from lazarus.schema.rundir import RunDir

    spec_file = RunDir(settings.home / "runs" / run_id).spec_file
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
