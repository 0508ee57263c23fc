"""The Temporal web UI tells a recovered run's story: headless Chromium opens the run's page and
finds the five stages in the timeline, each activity with its summary and the local ones (drain,
reschedule, replace_or_reshard) by their name; the screenshot is kept."""

from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from lazarus.workflows.stage_calls import LOCAL_STAGES
from tests.support.workers import demo_json, lazarus_env

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

CHROMIUM = shutil.which("chromium")
DEMO_SPEC = Path(__file__).resolve().parents[2] / "examples" / "demo.yaml"
SCREENSHOT = "LAZARUS_SCREENSHOT"
"""Where to copy the screenshot too (README's docs/web-ui-recovery.png is made so)."""

# As the project's set-up starts it: no sandbox (root in CI), and no background connections (the
# machine has no network; Chromium would try Google's hosts at every start).
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--window-size=1600,1250",
    "--virtual-time-budget=20000",
)


def chromium(profile: Path, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed: `make setup` installs it as root")
@pytest.mark.web_ui
def test_the_web_ui_shows_each_stage_of_a_recovery_with_its_summary(dev_env, home, tmp_path):
    spec = tmp_path / "demo.yaml"
    spec.write_text(DEMO_SPEC.read_text().replace("steps: 300 ", "steps: 60 "))
    env = lazarus_env(dev_env, home, f"ui-{uuid.uuid4().hex[:6]}")
    status = demo_json(env, "--spec", str(spec), "--kill-at-step", "25")
    assert status["state"] == "COMPLETED" and len(status["incidents"]) == 1

    page = f"http://127.0.0.1:{dev_env.ui_port}/namespaces/default/workflows/{status['run_id']}"
    expected = {
        "launch incarnation 0: dp=4 on 4 nodes (+1 spare)": "launch",
        "watch incarnation 0": "detect",
        "resume incarnation 1 on node-0, node-1, node-4, node-3": "resume",
        "watch incarnation 1": "detect",
        "give the run's nodes back to the pool": "release",
    }
    # The UI renders the history as its requests come back; a dump taken before the last one
    # (seen once in CI: one stage's row missing) is taken again, up to three times.
    for _ in range(3):
        dom = chromium(tmp_path / "profile", "--dump-dom", page).stdout
        labels = [html.unescape(label) for label in re.findall(r">([a-z_]+ \u2022 [^<]+)<", dom)]
        shown = dict(label.split(" \u2022 ", 1)[::-1] for label in labels)  # summary -> stage
        # A drain whose survivors took longer than a local activity waits (a loaded machine's) goes
        # on as an activity of its own, shown with its summary.
        shown.pop("drain node-2, incarnation 0 (incident 1: node_down): the rest of its graces", None)
        if shown == expected and all(f">{stage}<" in dom for stage in LOCAL_STAGES):
            break
    assert shown == expected, labels
    # drain, reschedule and replace_or_reshard are local activities: shown by their name, with no summary.
    assert all(f">{stage}<" in dom for stage in LOCAL_STAGES), [s for s in LOCAL_STAGES if f">{s}<" not in dom]

    screenshot = tmp_path / "web-ui-recovery.png"
    chromium(tmp_path / "profile", f"--screenshot={screenshot}", page)
    assert screenshot.stat().st_size > 50_000
    if os.environ.get(SCREENSHOT):
        shutil.copyfile(screenshot, os.environ[SCREENSHOT])
