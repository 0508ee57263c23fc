"""Client helpers: connect with the pydantic converter, start a run, read its status."""

from __future__ import annotations

from pathlib import Path

from temporalio.client import Client, TLSConfig, WorkflowHandle
from temporalio.common import WorkflowIDReusePolicy
from temporalio.contrib.pydantic import pydantic_data_converter

from lazarus.config import Settings
from spec.records import RunStart, RunStatus
from spec.run import RunSpec
from workflows.training_run import TrainingRun


async def connect(settings: Settings) -> Client:
    """A Temporal client for the configured address and namespace (TLS when certificates are set)."""
    tls: TLSConfig | bool = False
    if settings.tls_cert or settings.tls_ca:
        read = lambda path: Path(path).read_bytes() if path else None  # noqa: E731
        tls = TLSConfig(client_cert=read(settings.tls_cert), client_private_key=read(settings.tls_key),
                        server_root_ca_cert=read(settings.tls_ca))
    return await Client.connect(settings.address, namespace=settings.namespace, tls=tls,
                                data_converter=pydantic_data_converter)


async def start_run(client: Client, settings: Settings, spec: RunSpec, run_id: str) -> WorkflowHandle:
    """Start the TrainingRun workflow; the run id is the workflow id."""
    return await client.start_workflow(
        TrainingRun.run, RunStart(run_id=run_id, spec=spec), id=run_id, task_queue=settings.task_queue,
        # A run id names one run directory; reusing it would resume a finished run's state.
        id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
    )


async def run_status(client: Client, run_id: str) -> RunStatus:
    """The run's status from its workflow (needs a worker to answer the query)."""
    return await client.get_workflow_handle(run_id).query(TrainingRun.status, result_type=RunStatus)
