"""Record workflow histories from real runs for the replay test: python tests/histories/record.py

Each history comes from a real run (dev server, local backend, trainer processes). Record
again when TrainingRun changes on purpose, and gate the change with workflow.patched so
that the old histories still replay.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import sys
import tempfile
from pathlib import Path

from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from infra.local import free_port
from infra.temporal_server import temporal_cli
from lazarus.config import Settings
from lazarus.demo import run_demo
from spec import load_spec

HERE = Path(__file__).resolve().parent
SMALL = HERE.parent / "specs" / "small.yaml"


async def record(name: str, spec, kill_at: int | None) -> None:
    with tempfile.TemporaryDirectory() as home:
        env = await WorkflowEnvironment.start_local(
            dev_server_existing_path=temporal_cli(), data_converter=pydantic_data_converter, port=free_port())
        try:
            settings = Settings(address=env.client.service_client.config.target_host, home=Path(home))
            with contextlib.redirect_stdout(io.StringIO()):
                code = await run_demo(settings, spec, kill_at, as_json=True)
            [execution] = [w async for w in env.client.list_workflows()]
            history = await env.client.get_workflow_handle(execution.id).fetch_history()
            (HERE / f"{name}.json").write_text(history.to_json())
            print(f"{name}: exit code {code}, {len(history.events)} events -> {HERE / (name + '.json')}", file=sys.stderr)
        finally:
            await env.shutdown()


async def main() -> None:
    spec = load_spec(SMALL)
    await record("hot_spare", spec, kill_at=15)
    no_spare = spec.model_copy(update={
        "cluster": spec.cluster.model_copy(update={"spare_nodes": 0}),
        "recovery": spec.recovery.model_copy(update={"capacity_wait_seconds": 3, "capacity_poll_seconds": 1}),
    })
    await record("no_spare", no_spare, kill_at=15)


if __name__ == "__main__":
    asyncio.run(main())
