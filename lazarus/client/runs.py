"""Client helpers: connect with the pydantic converter, start a run, read its status."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import NoReturn

from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
from temporalio.common import SearchAttributePair, TypedSearchAttributes, WorkflowIDReusePolicy
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.runtime import LogForwardingConfig, LoggingConfig, Runtime, TelemetryConfig, TelemetryFilter
from temporalio.service import RPCError

from lazarus.client.config import Settings
from lazarus.client.tls import tls_config
from lazarus.infra.harness.temporal_server import SEARCH_ATTRIBUTES
from lazarus.schema.records import RunStart, RunState, RunStatus
from lazarus.schema.run import RunSpec
from lazarus.schema.states import TERMINAL_STATES
from lazarus.workflows.training_run import INCIDENTS_ATTRIBUTE, STATE_ATTRIBUTE, TrainingRun

CORE_LOGGER = logging.getLogger("lazarus.temporal_core")
"""Where the Temporal core's (Rust) log lines go. Left to itself the core prints them on stdout,
which would break the one JSON document of a `--json` command; the CLI sends Python logging to stderr."""

CORE_LOG_FILTER = TelemetryFilter(core_level="WARN", other_level="ERROR")
"""The SDK's default levels: the core's warnings, other libraries' errors."""


def core_telemetry(log_filter: TelemetryFilter = CORE_LOG_FILTER) -> TelemetryConfig:
    """Telemetry that forwards the core's log lines passing `log_filter` to CORE_LOGGER."""
    forwarding = LogForwardingConfig(logger=CORE_LOGGER, append_target_to_name=False)
    return TelemetryConfig(logging=LoggingConfig(filter=log_filter, forwarding=forwarding))


@functools.cache
def core_runtime() -> Runtime:
    """The Temporal runtime of every client Lazarus connects (and so of their workers): one, as each
    runtime is a thread pool of its own."""
    return Runtime(telemetry=core_telemetry())


def exit_after(main: Callable[[], object]) -> NoReturn:
    """Run a script's `main` and end the process with its status, skipping the interpreter's
    teardown: Temporal's native client can crash there (sdk-python#300: "PyGILState_Release: thread
    state ... must be current", exit 134) or hang while a worker's threads wind down. What the
    script printed is flushed first; a traceback is printed for an error (status 1)."""
    code = 0
    try:
        result = main()
        code = result if isinstance(result, int) else 0
    except SystemExit as error:
        code = error.code if isinstance(error.code, int) else int(error.code is not None)
        if isinstance(error.code, str):
            print(error.code, file=sys.stderr)
    except BaseException as error:  # noqa: BLE001 - printed, then the process ends below with status 1
        traceback.print_exception(error)
        code = 1 if not isinstance(error, KeyboardInterrupt) else 130
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


STARTING_SECONDS = 30.0
"""How long a connect waits for a server that answers but whose frontend is not serving yet (seconds)."""

STARTING_RETRY_SECONDS = 0.2
"""Pause between connects to such a server (seconds)."""


async def connect(settings: Settings) -> Client:
    """A Temporal client for the configured address and namespace, with TLS when a LAZARUS_TEMPORAL_TLS_*
    setting is set (lazarus.client.tls: a bad setting raises TLSSettingsError before any connection).

    A dev server accepts connections a moment before its frontend serves ("Frontend is not
    healthy yet"): that answer is waited out for up to STARTING_SECONDS, so that a command run
    right after `lazarus server --detach` (or the demo, which starts one) does not fail.
    """
    deadline = time.monotonic() + STARTING_SECONDS
    while True:
        try:
            return await Client.connect(
                settings.address,
                namespace=settings.namespace,
                tls=tls_config(settings),
                data_converter=pydantic_data_converter,
                runtime=core_runtime(),
            )
        except RuntimeError as error:
            if "not healthy yet" not in str(error) or time.monotonic() > deadline:
                raise
            await asyncio.sleep(STARTING_RETRY_SECONDS)


async def has_search_attributes(client: Client, namespace: str) -> bool:
    """True when the namespace has LazarusState and LazarusIncidents (`lazarus server` registers them)."""
    try:
        response = await client.operator_service.list_search_attributes(
            ListSearchAttributesRequest(namespace=namespace)
        )
    except RPCError:
        return False  # e.g. no permission to ask: run without them
    return all(name in response.custom_attributes for name in SEARCH_ATTRIBUTES)


async def start_run(client: Client, settings: Settings, spec: RunSpec, run_id: str) -> WorkflowHandle:
    """Start the TrainingRun workflow; the run id is the workflow id."""
    searchable = await has_search_attributes(client, settings.namespace)
    attributes = (
        TypedSearchAttributes(
            [
                SearchAttributePair(STATE_ATTRIBUTE, RunState.PENDING.value),
                SearchAttributePair(INCIDENTS_ATTRIBUTE, 0),
            ]
        )
        if searchable
        else None
    )
    return await client.start_workflow(
        TrainingRun.run,
        RunStart(spec=spec, search_attributes=searchable),  # the run's id is the workflow id
        id=run_id,
        task_queue=settings.task_queue,
        search_attributes=attributes,
        # A run id names one run directory; reusing it would resume a finished run's state.
        id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
        task_timeout=workflow_task_timeout(spec),
        static_summary=static_summary(spec),
    )


class NotAdoptable(Exception):
    """The run cannot be adopted; the message says why, in one line."""


ADOPTABLE = {
    WorkflowExecutionStatus.TERMINATED,
    WorkflowExecutionStatus.CANCELED,
    WorkflowExecutionStatus.TIMED_OUT,
}
"""How a workflow may have ended and left its run's ranks training: not by the run's own end."""


async def adopt_run(client: Client, settings: Settings, run_id: str) -> tuple[WorkflowHandle, RunStatus]:
    """Start a new workflow for run `run_id`, whose workflow ended without ending the run (terminated
    by mistake): it carries the ended workflow's last status and spec, takes the run over (recorded
    as an adopt intervention and in the run's owner record) and takes it up where the cluster holds
    it. Returns its handle and the status it carried; NotAdoptable when there is nothing to adopt,
    RPCError when there is no such workflow."""
    from lazarus.client.reading import replayed_run

    description = await client.get_workflow_handle(run_id).describe()
    ended = description.status
    assert ended is not None, "the server says how every workflow stands"
    if ended not in ADOPTABLE:
        why = "its workflow still drives it" if ended == WorkflowExecutionStatus.RUNNING else "the run itself ended"
        raise NotAdoptable(f"run {run_id}'s workflow is {ended.name.lower()}: {why}, nothing to adopt")
    try:
        ended_run = await replayed_run(client, run_id)
    except RuntimeError as error:
        raise NotAdoptable(str(error)) from None
    status, start = ended_run.status(), ended_run.start_input()
    if status.state in TERMINAL_STATES:
        raise NotAdoptable(f"run {run_id} had ended {status.state.value} before its workflow did: nothing to adopt")
    status.segments += 1
    handle = await client.start_workflow(
        TrainingRun.run,
        RunStart(spec=start.spec, carried=status, search_attributes=start.search_attributes, adopt=True),
        id=run_id,
        task_queue=settings.task_queue,
        # Only a closed workflow's id is taken again, and only on purpose: this is that purpose.
        id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
        task_timeout=workflow_task_timeout(start.spec),
        static_summary=static_summary(start.spec),
    )
    return handle, status


def workflow_task_timeout(spec: RunSpec) -> timedelta:
    """The run's workflow task timeout (its policy's); a continue-as-new keeps it."""
    return timedelta(seconds=spec.recovery.workflow_task_timeout_seconds)


def static_summary(spec: RunSpec) -> str:
    """The run in one line, as the web UI shows it beside its id: spec, layout, nodes, length."""
    cluster = spec.cluster
    return (
        f"{spec.name}: {spec.layout.describe()} on {cluster.active_nodes} {cluster.backend} nodes "
        f"+ {cluster.spare_nodes} spare, {spec.trainer.steps} steps"
    )


async def run_status(client: Client, run_id: str) -> RunStatus:
    """The run's status from its workflow (needs a worker to answer the query)."""
    return await client.get_workflow_handle(run_id).query(TrainingRun.status)
