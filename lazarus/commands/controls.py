"""`lazarus run pause|resume|abort|drain-node|return-node|reshard|approve|set-policy`: steer a run.

Each command sends one workflow update with its own request model from lazarus.schema.controls,
and prints the workflow's answer. The run's worker carries the update out; when no worker serves
the run, a control says so in one line instead of waiting (lazarus/commands/unserved.py).
"""

from __future__ import annotations

import argparse

from lazarus.client.config import Settings
from lazarus.commands.common import RUN_HELP, UserError, connect_client, node_name, run_id


def _pause(args, controls):
    return controls.PauseRequest(reason=args.reason)


def _resume(args, controls):
    return controls.ResumeRequest(reason=args.reason)


def _abort(args, controls):
    return controls.AbortRequest(reason=args.reason)


def _drain_node(args, controls):
    return controls.DrainNodeRequest(node=args.node, reason=args.reason)


def _return_node(args, controls):
    return controls.ReturnNodeRequest(node=args.node)


def _reshard(args, controls):
    return controls.ReshardRequest(dp=args.dp)


def _approve(args, controls):
    return controls.ApproveRequest(action=args.action.replace("-", "_"), wait_seconds=args.wait_seconds)


def _set_policy(args, controls):
    return controls.SetPolicyRequest(changes=policy_changes(args.changes))


NEEDS_A_WORKER = (
    "The run's worker carries this out: when no worker serves the run (its `lazarus launch` or `lazarus worker` "
    "is gone), the command says so within seconds, with how to start one, and exits non-zero."
)

ABORT_WITHOUT_A_WORKER = (
    "Stop the run cleanly: its worker checkpoints, stops the ranks, and the run ends ABORTED; the newest "
    "checkpoint is kept. When no worker serves the run (its `lazarus launch` or `lazarus worker` is gone), "
    "abort does not wait for one: it terminates the run's workflow and SIGKILLs every process of the run "
    "through the local backend (the run directory under LAZARUS_HOME), so no rank outlives the abort; the "
    "run's nodes go back to the pool, its complete checkpoints stay, and the run reads as terminated. A "
    "Kubernetes or Slurm run, or a local run whose directory is not on this machine, is refused with how to "
    "start a worker."
)


def _control(run_commands: argparse._SubParsersAction, name: str, update: str, request, helptext: str):
    """A subcommand that sends the update named `update` (a TrainingRun method) with `request(args, controls)`."""
    description = (
        ABORT_WITHOUT_A_WORKER if update == "abort" else f"{helptext[0].upper()}{helptext[1:]}. {NEEDS_A_WORKER}"
    )
    command = run_commands.add_parser(name, help=helptext, description=description)
    command.add_argument("run_id", metavar="RUN", type=run_id, help=RUN_HELP)
    command.set_defaults(handler=send_update, update=update, request=request)
    return command


def register(run_commands: argparse._SubParsersAction) -> None:
    """Add the operator controls to `lazarus run`."""
    for name, update, request, helptext in (
        ("pause", "pause", _pause, "checkpoint, stop the ranks, hold the nodes"),
        ("resume", "resume", _resume, "continue a paused run on the nodes it held"),
        ("abort", "abort", _abort, "stop the run cleanly; the newest checkpoint is kept"),
    ):
        command = _control(run_commands, name, update, request, helptext)
        command.add_argument("--reason", default="", help="why (recorded in the run's history)")
    drain = _control(
        run_commands,
        "drain-node",
        "drain_node",
        _drain_node,
        "treat a node as faulty: the same recovery as a detected fault",
    )
    drain.add_argument("node", metavar="NODE", type=node_name, help="the node to treat as faulty, e.g. node-2")
    drain.add_argument("--reason", default="", help="why (recorded on the incident)")
    back_node = _control(
        run_commands, "return-node", "return_node", _return_node, "a repaired node rejoins the run's spare pool"
    )
    back_node.add_argument("node", metavar="NODE", type=node_name, help="the repaired node, e.g. node-2")
    reshard = _control(
        run_commands, "reshard", "reshard", _reshard, "run at DP replicas: checkpoint, stop, re-plan, resume"
    )
    reshard.add_argument("dp", type=int, metavar="DP", help="data-parallel replicas to run at")
    approve = _control(
        run_commands, "approve", "approve", _approve, "answer an escalation (state WAITING_FOR_APPROVAL)"
    )
    approve.add_argument(
        "action",
        choices=["reshard-below-minimum", "wait-longer"],
        help="reshard below recovery.min_dp, or wait --wait-seconds longer for capacity",
    )
    approve.add_argument(
        "--wait-seconds", type=float, default=600.0, help="with wait-longer: how much longer (default 600)"
    )
    policy = _control(
        run_commands,
        "set-policy",
        "set_policy",
        _set_policy,
        "change recovery policy fields, e.g. hang_after_seconds=60 stages.drain.max_attempts=9",
    )
    policy.add_argument(
        "changes", nargs="+", metavar="FIELD=VALUE", help="recovery policy fields, e.g. hang_after_seconds=60"
    )


def policy_changes(pairs: list[str]) -> dict:
    """FIELD=VALUE pairs (dotted fields nest, values are YAML scalars) as a nested dict; a pair that
    is not one, or names a field twice, is the user's mistake, said in one line."""
    import json

    import yaml

    from lazarus.schema.names import shown

    changes: dict = {}
    for pair in pairs:
        field, sep, text = pair.partition("=")
        *path, last = field.split(".")
        if not sep or not all(path) or not last:
            raise UserError(f"set-policy: {shown(pair)} is not FIELD=VALUE (e.g. hang_after_seconds=60)")
        try:
            value = yaml.safe_load(text)
            # What JSON cannot carry (a date, binary, .inf) would fail to encode, or arrive changed.
            json.dumps(value, allow_nan=False)
        except (yaml.YAMLError, TypeError, ValueError):
            raise UserError(f"set-policy: {field}: {shown(text)} is not a value (e.g. 60, 2.5, true)") from None
        target = changes
        for part in path:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                break
        if not isinstance(target, dict) or last in target:
            raise UserError(f"set-policy: {field} is given twice, or inside a field given a value")
        target[last] = value
    return changes


async def send_update(args: argparse.Namespace, settings: Settings) -> int:
    """Send the command's update to the run and print its answer; a refusal is said in one line.

    Never waits on a worker that is not there (lazarus/commands/unserved.py): with none serving the
    run, an abort ends it here and any other control is refused with how to start a worker.
    """
    from pydantic import ValidationError
    from temporalio.client import (
        WorkflowUpdateFailedError,
        WorkflowUpdateRPCTimeoutOrCancelledError,
        WorkflowUpdateStage,
    )
    from temporalio.service import RPCError

    from lazarus.commands import unserved
    from lazarus.schema import controls
    from lazarus.schema.load import validation_message
    from lazarus.workflows.training_run import TrainingRun

    try:
        request = args.request(args, controls)
    except ValidationError as error:
        raise UserError(f"{args.run_command}: {validation_message(error)}") from None
    client = await connect_client(settings)
    handle = client.get_workflow_handle(args.run_id)
    sent = ""
    try:
        task_queue = await running_task_queue(handle, args)
    except RPCError as error:
        raise UserError(f"{args.run_command}: run {args.run_id}: {error.message}") from None
    try:
        why = await unserved.why_unserved(client, args.run_id, task_queue)
        if why is None:
            update = await handle.start_update(
                getattr(TrainingRun, args.update),
                request,
                wait_for_stage=WorkflowUpdateStage.ACCEPTED,
                rpc_timeout=unserved.accept_timeout(),
            )
            answer, why = await unserved.carried_out(update, client, args.run_id, task_queue)
            if answer is not None:
                print(f"{answer.message} (state {answer.state})")
                return 0
            sent = ": it was accepted and is carried out once a worker serves the run again"
    except WorkflowUpdateRPCTimeoutOrCancelledError:
        why = f"no worker took the request within {unserved.ACCEPT_SECONDS:g} s"
        sent = " (a worker that comes back soon may still carry it out)"
    except WorkflowUpdateFailedError as error:
        cause = error.cause
        raise UserError(f"{args.run_command} refused: {getattr(cause, 'message', None) or cause}") from None
    except RPCError as error:
        raise UserError(f"{args.run_command}: run {args.run_id}: {error.message}") from None
    print(await unserved.without_worker(args, settings, client, task_queue, why, sent))
    return 0


async def running_task_queue(handle, args: argparse.Namespace) -> str:
    """The task queue of the run's workflow; a run that has ended is refused in one line."""
    from temporalio.client import WorkflowExecutionStatus

    description = await handle.describe()
    if description.status != WorkflowExecutionStatus.RUNNING:
        raise UserError(
            f"{args.run_command} refused: run {args.run_id} has ended (its workflow is "
            f"{description.status.name.lower()}; `lazarus run status {args.run_id}` says how)"
        )
    return description.task_queue
