"""What makes a crash loop (workflows/incidents.py): the same program failure right after a restart
in place, or one before a step was trained again; never a node's fault."""

from __future__ import annotations

from lazarus.schema.records import Assignment, Incident, StageRecord
from lazarus.workflows.incidents import crash_loop, failure_signature
from tests.workflow.fakes import ACTIVE, fault, make_spec
from tests.workflow.test_program_errors import rank_error


def test_failures_are_the_same_whatever_rank_or_address():
    one = rank_error("RuntimeError: bad pointer 0x7f12ab")
    other = one.model_copy(update={"rank": 0, "error": "RuntimeError: bad pointer 0x7f99cd"})
    assert failure_signature(one) == failure_signature(other)
    coded = one.model_copy(update={"error": "", "exit_code": 3})
    assert failure_signature(coded) == "exit code 3" != failure_signature(one)


def test_a_node_fault_between_two_program_failures_is_no_loop():
    held = Assignment(incarnation=0, nodes=ACTIVE, layout=make_spec().layout, master_port=29400)

    def incident(number, report, outcome="recovered"):
        stage = StageRecord(started_at=report.occurred_at, ended_at=report.detected_at)
        return Incident(number=number, fault=report, old_assignment=held, stages={"detect": stage}, outcome=outcome)

    assert crash_loop([incident(1, rank_error()), incident(2, fault())], rank_error()) is None
    assert crash_loop([incident(1, rank_error())], rank_error()) is not None
    assert crash_loop([incident(1, rank_error())], rank_error("ValueError: other")) is None  # trained between
    assert crash_loop([incident(1, rank_error(), "interrupted")], rank_error("ValueError: other")) is not None
    assert crash_loop([incident(1, rank_error())], fault()) is None  # a node fault is never a crash loop
