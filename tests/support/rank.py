"""A stand-in rank for the backend suite: it reports a step every 50 ms through the session helper
until the controller asks the incarnation to stop, or the test asks it to exit with a code
(a file `exit-<rank>` in the run directory holding the code)."""

import sys
import time

from lazarus.session import TrainingSession

session = TrainingSession.from_environ()
print(f"stand-in rank {session.rank} of incarnation {session.incarnation} on {session.node}", flush=True)
order = session.run.root / f"exit-{session.rank}"
step = session.resume_step
while True:
    step += 1
    session.step_done(step)
    if session.run.stop_file(session.incarnation).exists():
        session.finish(step, stopped=True)
        sys.exit(0)
    if order.exists():
        code = int(order.read_text())
        session.fail(code, f"RuntimeError: asked to exit with code {code}")
        sys.exit(code)
    time.sleep(0.05)
