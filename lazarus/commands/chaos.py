"""`lazarus chaos kill-node|kill-domain|slow-node|return-node`: break or slow a node of a local run
(or a whole fault domain of the pool) on purpose, and repair it."""

from __future__ import annotations

import argparse

from lazarus.client.config import Settings
from lazarus.commands.common import RUN_HELP, UserError, local_cluster, node_name, run_id


def register(commands: argparse._SubParsersAction) -> None:
    """Add `chaos` and its actions to the top-level commands."""
    chaos = commands.add_parser("chaos", help="break things on purpose (local backend)")
    chaos_commands = chaos.add_subparsers(dest="chaos_command", required=True, metavar="ACTION")
    kill = chaos_commands.add_parser("kill-node", help="SIGKILL every process of a node and mark it dead")
    kill.add_argument("run_id", metavar="RUN", type=run_id, help=RUN_HELP)
    kill.add_argument("node", metavar="NODE", type=node_name, help="node name, e.g. node-2")
    kill.set_defaults(handler=kill_node)
    rack = chaos_commands.add_parser(
        "kill-domain",
        help="every node of a fault domain dies at once (a rack, a switch): nodes of every run that holds one",
        description="Kill a fault domain of the pool on purpose, as a rack's switch or power would: every node "
        "`lazarus pool domain` placed in it is marked dead at the same moment and every process of every run on "
        "it is SIGKILLed. Each run hit recovers by its own policy; spares go by cluster.priority, then first come.",
    )
    rack.add_argument("domain", metavar="DOMAIN", help="the fault domain, e.g. rack-2 (`lazarus pool` lists them)")
    rack.set_defaults(handler=kill_domain)
    slow = chaos_commands.add_parser(
        "slow-node",
        help="slow every process of a node by a factor (SIGSTOP/SIGCONT in cycles of 0.1 s) until Ctrl-C",
        description="Slow a node of a local run on purpose, as a slow GPU or a noisy neighbour would: its "
        "launcher and ranks get the CPU 1/FACTOR of the time, in cycles of 0.1 s, following the node into each "
        "new incarnation, until --seconds pass or Ctrl-C (or SIGTERM). Every process is left running at the end.",
    )
    slow.add_argument("run_id", metavar="RUN", type=run_id, help=RUN_HELP)
    slow.add_argument("node", metavar="NODE", type=node_name, help="node name, e.g. node-2")
    slow.add_argument("--factor", type=float, default=2.0, help="how many times slower, more than 1 (default 2)")
    slow.add_argument("--seconds", type=float, help="stop after this long (default: until Ctrl-C)")
    slow.set_defaults(handler=slow_node)
    back = chaos_commands.add_parser("return-node", help="return a repaired node to the pool as a healthy spare")
    back.add_argument("run_id", metavar="RUN", type=run_id, help=RUN_HELP)
    back.add_argument("node", metavar="NODE", type=node_name, help="the repaired node, e.g. node-2")
    back.set_defaults(handler=return_node)


def kill_node(args: argparse.Namespace, settings: Settings) -> int:
    """SIGKILL every process of the node and mark it dead."""
    from lazarus.infra.backend import ClusterError

    cluster = local_cluster(settings)
    try:
        _check_node_of_run(cluster, args.run_id, args.node)
        pids = cluster.kill_node(args.run_id, args.node)
    except ClusterError as error:
        raise UserError(str(error)) from None
    print(f"killed {args.node} of run {args.run_id} (pids: {', '.join(map(str, pids)) or 'none alive'})")
    return 0


def kill_domain(args: argparse.Namespace, settings: Settings) -> int:
    """Kill every node of a fault domain at once."""
    from lazarus.infra.backend import ClusterError

    try:
        held = local_cluster(settings).kill_domain(args.domain)
    except ClusterError as error:
        raise UserError(str(error)) from None
    runs = sorted({owner for owner in held.values() if owner})
    print(f"killed {args.domain}: {', '.join(held)} (nodes of {len(runs)} run(s): {', '.join(runs) or 'none'})")
    return 0


def slow_node(args: argparse.Namespace, settings: Settings) -> int:
    """Slow the node's processes by the factor until --seconds pass or a signal comes."""
    import signal
    import time

    from lazarus.infra.backend import ClusterError
    from lazarus.infra.backends.local.slow_node import slow_node as slow

    if not args.factor > 1:
        raise UserError(f"--factor must be more than 1, not {args.factor:g}")
    if args.seconds is not None and not args.seconds > 0:
        raise UserError(f"--seconds must be positive, not {args.seconds:g}")
    cluster = local_cluster(settings)
    try:
        _check_node_of_run(cluster, args.run_id, args.node)
    except ClusterError as error:
        raise UserError(str(error)) from None
    deadline = time.monotonic() + args.seconds if args.seconds is not None else float("inf")
    interrupted: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda number, _frame: interrupted.append(number))
    until = f"for {args.seconds:g} s" if args.seconds is not None else "until Ctrl-C"
    print(f"slowing {args.node} of run {args.run_id} by {args.factor:g}x {until}", flush=True)
    cycles = slow(
        cluster.run_dir(args.run_id),
        args.node,
        args.factor,
        lambda: not interrupted and time.monotonic() < deadline,
    )
    print(f"{args.node} runs at full speed again ({cycles} slowed cycles)")
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

    try:
        local_cluster(settings).return_node(args.run_id, args.node)
    except ClusterError as error:
        raise UserError(str(error)) from None
    print(f"{args.node} of run {args.run_id} is a healthy spare again")
    return 0
