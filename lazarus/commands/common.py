"""What every command shares: the user's mistakes as one line, a spec loaded, a client connected."""

from __future__ import annotations

from pathlib import Path

from lazarus.config import Settings


class UserError(Exception):
    """A mistake of the user's: printed as one line, exit code 2."""


def load_run_spec(path: str):
    """The run spec at `path`, its relative paths taken from the folder the command runs in
    (lazarus/local_paths.py); a bad one is the user's mistake, said in one line."""
    from lazarus.local_paths import anchor_paths
    from lazarus.schema.load import SpecError, load_spec

    try:
        return anchor_paths(load_spec(path), Path.cwd())
    except SpecError as error:
        raise UserError(str(error)) from None


async def connect_client(settings: Settings):
    """A Temporal client; an unreachable server is said in one line, with how to start one."""
    from lazarus.client import connect

    try:
        return await connect(settings)
    except RuntimeError as error:
        cause = "connection refused" if "Connection refused" in str(error) else str(error).splitlines()[0][:160]
        raise UserError(
            f"cannot reach Temporal at {settings.address} ({cause}); "
            f"start one with `lazarus server` or set LAZARUS_TEMPORAL_ADDRESS"
        ) from None
