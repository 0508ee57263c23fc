"""Node health: the check each node's launcher runs, and the node conditions a health agent sets."""

from __future__ import annotations

import threading

import pytest
from kubernetes import client as k8s
from pydantic import ValidationError

from lazarus.infra.backends.kubernetes.objects import node_sick
from lazarus.schema.health_checks import HealthChecks, run_check
from lazarus.trainer.agent.health_check import HealthCheck
from tests.support.waiting import wait_until


def test_a_check_passes_on_exit_0_and_fails_on_anything_else_or_no_answer(tmp_path):
    assert run_check(HealthChecks(command=["true"])) is None
    failed = run_check(HealthChecks(command=["sh", "-c", "echo 'GPU 3: Xid 79,  fallen off the bus'; exit 2"]))
    assert failed == "health check `sh -c echo 'GPU 3: Xid 79,  fallen off the bus'; exit 2` exited with 2: " + (
        "GPU 3: Xid 79, fallen off the bus"
    )
    slow = run_check(HealthChecks(command=["sleep", "5"], timeout_seconds=0.2, interval_seconds=1))
    assert slow == "health check `sleep 5` gave no answer within 0.2 s"
    missing = run_check(HealthChecks(command=[str(tmp_path / "no-such-check")]))
    assert missing.endswith("cannot run: No such file or directory")


def test_the_thread_runs_the_check_every_interval_until_it_fails_once(tmp_path):
    sick, log = tmp_path / "sick", tmp_path / "runs"

    def runs() -> int:
        return log.read_text().count("ran") if log.exists() else 0

    told = threading.Event()
    checks = HealthChecks(
        command=["sh", "-c", f"echo ran >> {log}; test ! -e {sick}"], interval_seconds=0.05, timeout_seconds=0.05
    )
    check = HealthCheck(checks, changed=told.set)
    check.start()
    try:
        wait_until(lambda: runs() >= 3, "three passing checks", timeout=10)
        assert check.failure is None and not told.is_set()
        sick.write_text("")
        assert told.wait(10), "the failing check was never reported"
        assert check.failure.startswith("health check `sh -c") and "exited with 1" in check.failure
        sick.unlink()  # passing again later does not make it healthy: no check runs after the failure
        ran = runs()
        told.clear()
        assert not told.wait(0.3) and runs() == ran and check.failure is not None
    finally:
        check.stop()


def test_the_spec_refuses_a_timeout_past_the_interval_and_ready_as_a_condition():
    with pytest.raises(ValidationError, match="exceeds health.interval_seconds"):
        HealthChecks(command=["nvidia-smi"], interval_seconds=10, timeout_seconds=30)
    with pytest.raises(ValidationError, match="Ready is watched always"):
        HealthChecks(node_conditions=["Ready"])


def test_a_node_condition_named_in_the_spec_and_true_makes_the_node_sick():
    def node(*conditions):
        return k8s.V1Node(status=k8s.V1NodeStatus(conditions=[k8s.V1NodeCondition(**c) for c in conditions]))

    healthy = node({"type": "Ready", "status": "True"}, {"type": "GpuUnhealthy", "status": "False"})
    assert node_sick(healthy, ["GpuUnhealthy"]) is None
    bad = node(
        {"type": "Ready", "status": "True"},
        {"type": "GpuUnhealthy", "status": "True", "reason": "XidError", "message": "Xid 79 on GPU 3"},
    )
    assert node_sick(bad, ["GpuUnhealthy"]) == "node condition GpuUnhealthy is True (XidError: Xid 79 on GPU 3)"
    assert node_sick(bad, ["KernelDeadlock"]) is None  # a condition the spec does not name is not watched
