"""Record workflow histories from real runs for the replay test: python tests/histories/record.py

Each history comes from a real run (dev server, local backend, trainer processes). When
TrainingRun changes on purpose, gate the change with workflow.patched and record new
histories beside the old ones, which keep replaying the unpatched branch:

  no_spare.json      recorded before resharding existed (waits, then fails); replays the
                     branch of workflows.training_run.RESHARD_PATCH that is not patched.
  hot_spare.json     a node killed, a spare takes its place.
  reshard.json       dp2 x pp2 without a spare: reshard to dp1.
  no_capacity.json   no spare and min_dp = dp: waits, then fails.
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
from spec import load_spec, parse_spec

HERE = Path(__file__).resolve().parent
SMALL = HERE.parent / "specs" / "small.yaml"
SMALL_PP = HERE.parent / "specs" / "small-pp.yaml"


def changed(path: Path, **sections) -> object:
    data = load_spec(path).model_dump(mode="json")
    for section, fields in sections.items():
        data[section].update(fields)
    return parse_spec(data)


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
    names = set(sys.argv[1:]) or {"hot_spare", "reshard", "no_capacity"}
    if "hot_spare" in names:
        await record("hot_spare", load_spec(SMALL), kill_at=15)
    if "reshard" in names:
        await record("reshard", changed(SMALL_PP, cluster={"spare_nodes": 0}), kill_at=15)
    if "no_capacity" in names:
        await record("no_capacity", changed(SMALL, cluster={"spare_nodes": 0}, recovery={
            "min_dp": 4, "capacity_wait_seconds": 3, "capacity_poll_seconds": 1}), kill_at=15)


if __name__ == "__main__":
    asyncio.run(main())
