"""What a user writes about node health (the spec's `health` section): a check each node runs, and
on Kubernetes the node conditions that mark a node sick. A node found sick is swapped for a free
spare in a planned recovery before it crashes the run (the straggler's path)."""

from __future__ import annotations

import subprocess

from pydantic import Field, model_validator

from lazarus.schema.base import MAX_SECONDS, Strict

OUTPUT_KEPT_CHARACTERS = 300
"""How much of a failed check's output the report keeps (characters, from its end)."""


class HealthChecks(Strict):
    """A node's health, as the site tells it: a command, or conditions set by a health agent."""

    command: list[str] = Field(
        default_factory=list,
        description=(
            "A command each node of the run runs while it trains (argv, e.g. [nvidia-smi] or "
            "[dcgmi, diag, -r, '1'] or a site script): exit status 0 is healthy; anything else, or no answer within "
            "timeout_seconds, makes the node sick. Empty: no check."
        ),
    )
    interval_seconds: float = Field(
        default=60.0, gt=0, le=MAX_SECONDS, description="How often each node runs the command (seconds)."
    )
    timeout_seconds: float = Field(
        default=30.0,
        gt=0,
        le=MAX_SECONDS,
        description="How long one run of the command may take before it fails (seconds).",
    )
    node_conditions: list[str] = Field(
        default_factory=list,
        description=(
            "Kubernetes: node condition types that mark a node sick when their status is True, besides Ready (those "
            "a node-problem-detector or a GPU health agent sets, e.g. KernelDeadlock, GpuUnhealthy)."
        ),
    )

    @model_validator(mode="after")
    def _timeout_within_interval(self) -> HealthChecks:
        if self.command and self.timeout_seconds > self.interval_seconds:
            raise ValueError(
                f"health.timeout_seconds: {self.timeout_seconds:g} exceeds health.interval_seconds "
                f"{self.interval_seconds:g}: a check would still run when the next is due"
            )
        if "Ready" in self.node_conditions:
            raise ValueError("health.node_conditions: Ready is watched always; name the conditions a health agent sets")
        return self


def run_check(checks: HealthChecks, cwd=None, env: dict[str, str] | None = None) -> str | None:
    """Run the check once (in `cwd`, with `env`: default this process's): None when it passed, else
    why it failed, in one line. A node's launcher runs it while the node trains; the controller on a
    spare, before a run claims it."""
    shown = " ".join(checks.command)
    try:
        done = subprocess.run(
            checks.command,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=checks.timeout_seconds,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return f"health check `{shown}` gave no answer within {checks.timeout_seconds:g} s"
    except OSError as error:
        return f"health check `{shown}` cannot run: {error.strerror}"
    if done.returncode == 0:
        return None
    said = " ".join(done.stdout.decode(errors="replace").split())[-OUTPUT_KEPT_CHARACTERS:]
    return f"health check `{shown}` exited with {done.returncode}" + (f": {said}" if said else "")
