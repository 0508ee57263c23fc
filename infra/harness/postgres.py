"""A real PostgreSQL server on this machine, for development, the tests and the fleet bench: Debian's
postgresql (initdb, pg_ctl, postgres), one database cluster kept in a folder, listening on a free
port of 127.0.0.1 only, its one user `lazarus` let in without a password from that address alone.

    python -m lazarus.infra.harness.postgres up [--folder .lazarus/postgres]     # prints LAZARUS_STORE=...
    python -m lazarus.infra.harness.postgres down [--folder .lazarus/postgres]

`make postgres` installs the packages (as root, with apt-get) and starts one. PostgreSQL refuses to
run as root: as root, the server runs as the postgres user, with its data in a folder of /tmp that
user can reach (the harness's folder may sit under a home it cannot enter), named in `data_dir`.
A user with a database of their own passes its URL in LAZARUS_STORE instead.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lazarus.infra.backend import free_ports

PACKAGES = "postgresql"
USER = "lazarus"
DATABASE = "lazarus"
START_SECONDS = 60.0
"""How long pg_ctl waits for the server to accept connections (seconds); under a second here."""


class PostgresError(RuntimeError):
    """The server cannot be started, or did not come up."""


def bin_dir() -> Path | None:
    """The folder of Debian's PostgreSQL programs (the newest version installed), or None."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=lambda p: int(p.parent.parent.name))
    if found:
        return found[-1].parent
    on_path = shutil.which("pg_ctl")
    return Path(on_path).resolve().parent if on_path else None


def why_not_startable() -> str | None:
    """Why a server cannot start on this machine (no PostgreSQL, no postgres user), or None."""
    folder = bin_dir()
    if folder is None or not all((folder / name).exists() for name in ("initdb", "postgres", "createdb")):
        return f"PostgreSQL is not installed (initdb, pg_ctl): `make postgres-packages` installs {PACKAGES} as root"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "PostgreSQL runs as a user other than root: no postgres user (install the postgresql package)"
    return None


class PostgresServer:
    """One PostgreSQL database cluster kept in `folder`: started, restarted, killed and stopped here.
    Unless `durable`, it skips fsync (a test's data need not survive the machine)."""

    def __init__(self, folder: Path, durable: bool = True):
        self.folder = Path(folder)
        self.durable = durable

    @property
    def data(self) -> Path:
        """The data directory (as root: a folder of /tmp that the postgres user owns)."""
        pointer = self.folder / "data_dir"
        return Path(pointer.read_text().strip()) if pointer.exists() else self.folder / "data"

    @property
    def port(self) -> int:
        return int((self.folder / "port").read_text())

    @property
    def url(self) -> str:
        """The store URL of its database (LAZARUS_STORE)."""
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{DATABASE}"

    def _as_owner(self, *command: str | Path) -> list[str]:
        """The command as the user the server runs as (postgres when this process is root)."""
        words = [str(word) for word in command]
        return ["runuser", "-u", "postgres", "--", *words] if os.geteuid() == 0 else words

    def _run(self, *command: str | Path, timeout: float = START_SECONDS) -> None:
        done = subprocess.run(self._as_owner(*command), capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip().splitlines()
            raise PostgresError(f"{Path(str(command[0])).name}: {said[-1] if said else f'exit {done.returncode}'}")

    def start(self) -> None:
        """Make the database cluster (once), start the server on a free port and make the database;
        PostgresError, the server stopped, otherwise."""
        why = why_not_startable()
        if why is not None:
            raise PostgresError(why)
        programs = bin_dir()
        assert programs is not None
        self.folder.mkdir(parents=True, exist_ok=True)
        made = not (self.data / "PG_VERSION").exists()
        if made:
            self._make_cluster(programs)
        (self.folder / "port").write_text(str(free_ports(1)[0]))
        try:
            self._start_server(programs)
            if made:
                self._run(programs / "createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", USER, DATABASE)
        except BaseException:
            self.stop()
            raise

    def _make_cluster(self, programs: Path) -> None:
        if os.geteuid() == 0:
            data = Path(tempfile.mkdtemp(prefix="lazarus-postgres-")) / "data"
            owner = pwd.getpwnam("postgres")
            os.chown(data.parent, owner.pw_uid, owner.pw_gid)
            (self.folder / "data_dir").write_text(str(data))
        self._run(
            programs / "initdb", "-D", self.data, "-U", USER, "--auth=trust", "-E", "UTF8", "--no-instructions", "-N"
        )
        # Connections from 127.0.0.1 only (listen_addresses below), so trust lets in this machine alone.
        settings = ["listen_addresses = '127.0.0.1'", "max_connections = 200"]
        if not self.durable:
            settings += ["fsync = off", "full_page_writes = off"]  # a crash of the server alone loses nothing
        with open(self.data / "postgresql.auto.conf", "a") as conf:
            conf.write("\n".join(settings) + "\n")

    def _start_server(self, programs: Path) -> None:
        options = f"-p {self.port} -k {self.data.parent}"
        self._run(
            programs / "pg_ctl", "-D", self.data, "-l", self.data.parent / "server.log", "-o", options, "-w", "start"
        )

    def restart(self) -> None:
        """Stop the server at once, as a crash would (connections cut, no checkpoint), and start it again
        on the same port: what it committed is there, what was under way is not."""
        programs = bin_dir()
        assert programs is not None
        self._run(programs / "pg_ctl", "-D", self.data, "-m", "immediate", "-w", "stop")
        self._start_server(programs)

    def pid(self) -> int | None:
        """The server's process id (the postmaster), while it runs."""
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def stop(self, remove: bool = True) -> None:
        """Stop the server (fast: connections cut, a checkpoint) and, with `remove`, delete its data."""
        programs = bin_dir()
        if programs is not None and self.pid() is not None:
            try:
                self._run(programs / "pg_ctl", "-D", self.data, "-m", "fast", "-w", "stop")
            except (PostgresError, subprocess.TimeoutExpired):
                pid = self.pid()
                # The postmaster this harness started on this machine, by the pid it recorded in its data.
                with contextlib.suppress(ProcessLookupError, TypeError):
                    os.kill(pid, signal.SIGKILL)  # type: ignore[arg-type]
                time.sleep(0.5)
        if remove:
            if (self.folder / "data_dir").exists():
                shutil.rmtree(self.data.parent, ignore_errors=True)
                (self.folder / "data_dir").unlink()
            shutil.rmtree(self.folder / "data", ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """`up` starts a server in --folder and prints its URL, `down` stops it and deletes its data."""
    parser = argparse.ArgumentParser(
        prog="python -m lazarus.infra.harness.postgres", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument("--folder", default=".lazarus/postgres", help="where the server keeps its files")
    args = parser.parse_args(argv)
    server = PostgresServer(Path(args.folder).resolve())
    try:
        if args.action == "down":
            server.stop()
            print(f"stopped the PostgreSQL server of {server.folder} and deleted its data")
            return 0
        server.start()
    except PostgresError as error:
        print(f"postgres: {error}", file=sys.stderr)
        return 1
    print(f"PostgreSQL up on 127.0.0.1:{server.port}; export LAZARUS_STORE={server.url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
