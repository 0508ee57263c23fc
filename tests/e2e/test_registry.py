"""A backend added by registering one class: the commands, the worker and a recovery find it
through infra/registry.py, and no file of the product names it."""

from __future__ import annotations

import uuid

import pytest

from lazarus.cli import build_parser
from lazarus.client.config import Settings
from lazarus.commands.common import load_run_spec, open_cluster
from lazarus.commands.demo_run import drive_run
from lazarus.infra import registry
from lazarus.infra.backends.local.cluster import LocalCluster
from lazarus.schema import RunState
from lazarus.worker import build_worker
from tests.support.runs import SMALL_SPEC, losses

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


class LedgerCluster(LocalCluster):
    """This machine's nodes, with a ledger of the launches and quarantines the controller ordered."""

    backend = "ledger"
    ledgers: dict[str, list[tuple]] = {}  # home -> its ledger: a worker opens the backend itself

    def start_ranks(self, run_id, incarnation, resume_step, *args, **kwargs):
        self.ledgers.setdefault(str(self.home), []).append(("start", incarnation, resume_step))
        return super().start_ranks(run_id, incarnation, resume_step, *args, **kwargs)

    def quarantine(self, run_id, nodes, reason, counted=True):
        self.ledgers.setdefault(str(self.home), []).append(("quarantine", tuple(nodes)))
        return super().quarantine(run_id, nodes, reason, counted)


@pytest.fixture
def ledger_backend():
    registry.register("ledger", LedgerCluster, "this machine's nodes, with a ledger of the controller's orders")
    yield
    registry.unregister("ledger")


async def test_a_registered_backend_serves_a_run_through_a_recovery(ledger_backend, dev_env, home, tmp_path, reference):
    spec_file = tmp_path / "run.yaml"
    spec_file.write_text(SMALL_SPEC.read_text().replace("backend: local", "backend: ledger"))
    spec = load_run_spec(spec_file)  # the command's check: a registered name
    assert spec.cluster.backend == "ledger"
    assert build_parser().parse_args(["worker", "--backend", "ledger"]).backend == "ledger"

    settings = Settings(task_queue=f"e2e-{uuid.uuid4().hex[:8]}", home=home)
    cluster = open_cluster("ledger", settings)
    assert isinstance(cluster, LedgerCluster)
    run_id = f"ledger-{uuid.uuid4().hex[:6]}"
    async with build_worker(dev_env.client, settings.task_queue, cluster):
        status = await drive_run(dev_env.client, settings, cluster, spec, run_id, 15, say=lambda _: None)

    assert status.state == RunState.COMPLETED and status.step == spec.trainer.steps
    [incident] = status.incidents
    assert incident.decision.replacements == {"node-2": "node-4"}
    # The launch and the recovery went through the registered class, and nothing else.
    resumed = incident.resumed_from_step
    assert LedgerCluster.ledgers[str(cluster.home)] == [
        ("start", 0, 0),
        ("quarantine", ("node-2",)),
        ("start", 1, resumed),
    ]
    trained = losses(cluster.run_dir(run_id), incarnation=1)
    expected = reference(SMALL_SPEC)
    assert trained == {step: expected[step] for step in range(resumed + 1, spec.trainer.steps + 1)}


def test_a_worker_refuses_a_spec_of_another_or_of_no_backend(ledger_backend, home):
    cluster = registry.open_backend("ledger", registry.BackendOptions(home))
    assert registry.refuses(cluster, "ledger") is None
    assert registry.refuses(cluster, "local") == (
        "cluster.backend is 'local' but this worker drives the 'ledger' backend; "
        "start a worker with `lazarus worker --backend local`"
    )
    assert registry.refuses(cluster, "lsf") == (
        "cluster.backend: 'lsf' is not a backend; the backends are local, kubernetes, slurm, ledger"
    )
    # The simulated backend stands in for the local one: a spec never names it.
    assert "simulated" in registry.names() and "simulated" not in registry.spec_names()
