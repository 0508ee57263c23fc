"""`lazarus chaos kill-node|return-node`: break a node of a local run on purpose, and repair it."""

from __future__ import annotations

import argparse

from lazarus.commands.common import UserError, node_name, run_id
from lazarus.config import Settings


def register(commands: argparse._SubParsersAction) -> None:
    """Add `chaos` and its actions to the top-level commands."""
    chaos = commands.add_parser("chaos", help="break things on purpose (local backend)")
    chaos_commands = chaos.add_subparsers(dest="chaos_command", required=True, metavar="ACTION")
    kill = chaos_commands.add_parser("kill-node", help="SIGKILL every process of a node and mark it dead")
    kill.add_argument("run_id", metavar="RUN", type=run_id)
    kill.add_argument("node", metavar="NODE", type=node_name, help="node name, e.g. node-2")
    kill.set_defaults(handler=kill_node)
    back = chaos_commands.add_parser("return-node", help="return a repaired node to the pool as a healthy spare")
    back.add_argument("run_id", metavar="RUN", type=run_id)
    back.add_argument("node", metavar="NODE", type=node_name)
    back.set_defaults(handler=return_node)


def kill_node(args: argparse.Namespace, settings: Settings) -> int:
    """SIGKILL every process of the node and mark it dead."""
    from lazarus.infra.backend import ClusterError
    from lazarus.infra.local import LocalCluster

    cluster = LocalCluster(settings.home)
    try:
        _check_node_of_run(cluster, args.run_id, args.node)
        pids = cluster.kill_node(args.run_id, args.node)
    except ClusterError as error:
        raise UserError(str(error)) from None
    print(f"killed {args.node} of run {args.run_id} (pids: {', '.join(map(str, pids)) or 'none alive'})")
    return 0


def _check_node_of_run(cluster, run_id: str, node: str) -> None:
    """UserError naming the run's nodes when `node` is none of them (its active nodes, what it
    quarantined, the pool's free spares): killing a stranger would mark a node dead for nothing."""
    nodes = cluster.inventory(run_id).nodes
    if node not in {n.name for n in nodes}:
        listed = ", ".join(f"{n.name} ({n.role})" for n in nodes) or "none"
        raise UserError(f"{node} is not a node of run {run_id}; its nodes: {listed}")


def return_node(args: argparse.Namespace, settings: Settings) -> int:
    """Return the node to the run's pool as a healthy spare."""
    from lazarus.infra.backend import ClusterError
    from lazarus.infra.local import LocalCluster

    try:
        LocalCluster(settings.home).return_node(args.run_id, args.node)
    except ClusterError as error:
        raise UserError(str(error)) from None
    print(f"{args.node} of run {args.run_id} is a healthy spare again")
    return 0
