"""What every command shares: the user's mistakes as one line, a spec loaded, a client connected."""

from __future__ import annotations

import argparse
from pathlib import Path

from lazarus.client.config import Settings


class UserError(Exception):
    """A mistake of the user's: printed as one line, exit code 2."""


class OneLineParser(argparse.ArgumentParser):
    """A parser whose every complaint is one line naming the argument (UserError), never usage text;
    its subcommands' parsers are of the same class (argparse makes them with the parent's)."""

    def error(self, message: str):
        raise UserError(f"{message} (see `{self.prog} --help`)")


def _checked(check, value: str) -> str:
    try:
        return check(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


RUN_HELP = "the run's id: its workflow id, and its folder under LAZARUS_HOME/runs"


def run_id(value: str) -> str:
    """argparse type of RUN and --run-id: a run id as lazarus.schema.names allows it, else one line saying why."""
    from lazarus.schema.names import check_run_id

    return _checked(check_run_id, value)


def node_name(value: str) -> str:
    """argparse type of NODE: a node name as lazarus.schema.names allows it, else one line saying why."""
    from lazarus.schema.names import check_node_name

    return _checked(check_node_name, value)


def positive_int(value: str) -> int:
    """argparse type of a count: a whole number, 1 or more."""
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number of 1 or more")
    return number


def load_run_spec(path: str | Path):
    """The run spec at `path`, its relative paths taken from the folder the command runs in
    (lazarus/commands/local_paths.py); a bad one is the user's mistake, said in one line."""
    from lazarus.commands.local_paths import anchor_paths
    from lazarus.schema.load import SpecError, load_spec

    try:
        spec = load_spec(path)
    except SpecError as error:
        raise UserError(str(error)) from None
    return anchor_paths(spec, Path.cwd(), registered_backend(spec.cluster.backend).shares_paths)


def open_cluster(name: str, settings: Settings, **options):
    """The backend `name` (infra/registry.py) on LAZARUS_HOME, its cluster reached; a name no
    backend has, a missing Slurm or Kubernetes API is one line (UserError), no traceback. `options`
    are BackendOptions' other fields."""
    from lazarus.infra.backend import ClusterError
    from lazarus.infra.registry import BackendOptions, open_backend
    from lazarus.infra.store import StoreError, StoreURLError

    try:
        options = {"store": settings.store, "runs": settings.runs, **options}
        return open_backend(name, BackendOptions(settings.home, **options))
    except ClusterError as error:
        raise UserError(f"--backend {name}: {error}") from None
    except (StoreError, StoreURLError) as error:
        raise UserError(str(error)) from None


def local_cluster(settings: Settings):
    """The local backend on the settings' home, store and runs' folder (LAZARUS_STORE, LAZARUS_RUNS)."""
    from lazarus.infra.backends.local.cluster import LocalCluster

    return LocalCluster(settings.home, store=settings.store, runs=settings.runs)


def registered_backend(name: str, named_by: str = "cluster.backend"):
    """The class of the backend `name` (infra/registry.py); UserError, saying what `named_by` it
    (a spec's field, a flag), where none is registered under that name."""
    from lazarus.infra.registry import UnknownBackend, backend_class

    try:
        return backend_class(name)
    except UnknownBackend as error:
        raise UserError(f"{named_by}: {error}") from None


def server_error(error: BaseException, address: str) -> str | None:
    """An error the Temporal server at `address` answered (temporalio's RPCError), or a call to it
    that timed out, as one line naming the server and its answer; None for any other error."""
    from temporalio.client import RPCTimeoutOrCancelledError
    from temporalio.service import RPCError

    if isinstance(error, RPCError):
        message = " ".join(error.message.split()) or "no message"
        return f"Temporal at {address} answered {error.status.name}: {message}"
    if isinstance(error, RPCTimeoutOrCancelledError):
        return f"Temporal at {address} did not answer in time ({error})"
    return None


async def connect_client(settings: Settings):
    """A Temporal client; an unreachable server, a bad TLS setting or a failed TLS handshake is said
    in one line, with what to do about it."""
    from lazarus.client.runs import connect
    from lazarus.client.tls import TLSSettingsError, describe_failure

    try:
        return await connect(settings)
    except TLSSettingsError as error:
        raise UserError(str(error)) from None
    except RuntimeError as error:
        tls_problem = describe_failure(str(error), settings)
        if tls_problem:
            raise UserError(tls_problem) from None
        cause = "connection refused" if "Connection refused" in str(error) else str(error).splitlines()[0][:160]
        raise UserError(
            f"cannot reach Temporal at {settings.address} ({cause}); "
            f"start one with `lazarus server` or set LAZARUS_TEMPORAL_ADDRESS"
        ) from None
