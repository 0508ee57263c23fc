"""A real Slurm cluster on this machine, for development and the tests: Debian's munge, slurmctld
and slurmd (Slurm 22.05), one `slurmd -N node-I` per node (named as the local backend's pool
names its nodes, so that the Slurm backend's pool and Slurm speak of the same nodes), every node
this host on a port of its own
(`NodeHostname=localhost Port=[...]`), everything under one folder and on free ports, so that it
never meets a site's own Slurm or another test's cluster.

    python -m lazarus.infra.harness.slurm_daemons up [--folder .lazarus/slurm] [--nodes 5]
    python -m lazarus.infra.harness.slurm_daemons down [--folder .lazarus/slurm]

`make slurm` installs the packages (as root, with apt-get) and starts one. The clients (sinfo,
srun, scontrol) find it through SLURM_CONF (`SlurmDaemons.env`). Starting needs root: munged runs
as the munge user with a key of its own, slurmctld and slurmd as root (SlurmUser=root), as
../shared/FIELD-NOTES.md measured. munged's socket and key live in a folder of /tmp that the munge
user can reach (the cluster's own folder may sit under a home it cannot enter).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import pwd
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from lazarus.infra.backend import free_ports

BINARIES = ("munged", "slurmctld", "slurmd", "sinfo", "srun", "scontrol", "salloc", "scancel", "squeue")
PACKAGES = "slurmctld slurmd slurm-client munge"
START_SECONDS = 30.0
"""How long the nodes get to show idle in sinfo after the daemons started (seconds); about 3 here."""


class SlurmDaemonsError(RuntimeError):
    """The cluster cannot be started, or did not come up."""


def why_not_startable() -> str | None:
    """Why a cluster cannot start on this machine (missing binaries, not root), or None."""
    missing = [name for name in BINARIES if _found(name) is None]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing): `make slurm` installs {PACKAGES} as root"
    if os.geteuid() != 0:
        return "a Slurm cluster of its own needs root here (slurmd and slurmctld run as root, munged as munge)"
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "no munge user: install the munge package"
    return None


def _found(name: str) -> str | None:
    return shutil.which(name) or next(
        (p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.access(p, os.X_OK)), None
    )


def _binary(name: str) -> str:
    """The path of a Slurm or munge program (why_not_startable has checked that each is installed)."""
    found = _found(name)
    if found is None:
        raise SlurmDaemonsError(f"{name} is not installed: `make slurm` installs {PACKAGES} as root")
    return found


@dataclass
class SlurmDaemons:
    """A cluster of `nodes` nodes (node-0, node-1, ...) kept in `folder`."""

    folder: Path
    nodes: int = 5
    partition: str = "lazarus"

    @property
    def conf(self) -> Path:
        return self.folder / "slurm.conf"

    @property
    def munge_home(self) -> Path:
        """munged's folder: /tmp, named after the cluster's folder, reachable by the munge user."""
        digest = hashlib.sha1(str(self.folder.resolve()).encode()).hexdigest()[:12]
        return Path("/tmp") / f"lazarus-munge-{digest}"

    @property
    def node_names(self) -> list[str]:
        return [f"node-{i}" for i in range(self.nodes)]

    @property
    def env(self) -> dict[str, str]:
        """The environment Slurm's clients need to reach this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self) -> None:
        """Write the key and slurm.conf, start munged, slurmctld and every slurmd, and return once
        sinfo shows every node idle; SlurmDaemonsError (the daemons stopped) otherwise."""
        why = why_not_startable()
        if why is not None:
            raise SlurmDaemonsError(why)
        for name in ("state", "spool", "log", "run"):
            (self.folder / name).mkdir(parents=True, exist_ok=True)
        self._start_munge()
        ports = free_ports(self.nodes + 1)
        self.conf.write_text(self._conf(ports[0], ports[1:]))
        try:
            self._run("slurmctld", "-f", str(self.conf))
            for node in self.node_names:
                self._run("slurmd", "-f", str(self.conf), "-N", node)
            self._await_idle()
        except BaseException:
            self.stop()
            raise

    def _start_munge(self) -> None:
        home, munge = self.munge_home, pwd.getpwnam("munge")
        if (home / "munged.pid").exists():
            self._kill(home / "munged.pid", "munged")
        key_dir, socket_dir = home / "key", home / "socket"
        for folder, mode in ((home, 0o755), (key_dir, 0o700), (socket_dir, 0o755)):
            folder.mkdir(mode=mode, exist_ok=True)
            os.chmod(folder, mode)  # mkdir's mode is masked by the umask
            if folder != home:
                os.chown(folder, munge.pw_uid, munge.pw_gid)
        key = key_dir / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
        os.chown(key, munge.pw_uid, munge.pw_gid)
        os.chmod(key, 0o400)
        # munged keeps its pid, log and seed beside its key: files of the munge user.
        self._run(
            "runuser",
            "-u",
            "munge",
            "--",
            _binary("munged"),
            f"--socket={socket_dir / 'munge.socket'}",
            f"--key-file={key}",
            f"--pid-file={key_dir / 'munged.pid'}",
            f"--log-file={key_dir / 'munged.log'}",
            f"--seed-file={key_dir / 'munged.seed'}",
        )

    def _conf(self, controller_port: int, node_ports: list[int]) -> str:
        folder, names = self.folder, self.node_names
        return "\n".join(
            [
                "# A cluster of lazarus.infra.harness.slurm_daemons: every node is this host, on a port of its own.",
                "ClusterName=lazarus",
                "SlurmctldHost=localhost",
                f"SlurmctldPort={controller_port}",
                f"SlurmdPort={node_ports[0]}",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={self.munge_home / 'socket' / 'munge.socket'}",
                "SlurmUser=root",
                "SlurmdUser=root",
                f"StateSaveLocation={folder / 'state'}",
                f"SlurmdSpoolDir={folder / 'spool'}/%n",
                f"SlurmctldPidFile={folder / 'run' / 'slurmctld.pid'}",
                f"SlurmdPidFile={folder / 'run'}/slurmd-%n.pid",
                f"SlurmctldLogFile={folder / 'log' / 'slurmctld.log'}",
                f"SlurmdLogFile={folder / 'log'}/slurmd-%n.log",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "SelectType=select/cons_tres",
                "MpiDefault=none",
                "JobCompType=jobcomp/none",
                "AccountingStorageType=accounting_storage/none",
                # A dead node is noticed within seconds (sites run 300 s: detection comes from the job).
                "ReturnToService=2",
                "SlurmdTimeout=5",
                "MessageTimeout=3",
                "KillWait=2",
                f"NodeName=node-[0-{len(names) - 1}] NodeHostname=localhost Port=[{','.join(map(str, node_ports))}] "
                "CPUs=2 RealMemory=4000",
                f"PartitionName={self.partition} Nodes=node-[0-{len(names) - 1}] Default=YES MaxTime=INFINITE State=UP "
                "OverSubscribe=YES",
                "",
            ]
        )

    def _run(self, *command: str) -> None:
        """Run a daemon's start command (it forks into the background and returns)."""
        binary = command[0] if command[0] == "runuser" else _binary(command[0])
        done = subprocess.run([binary, *command[1:]], capture_output=True, text=True, timeout=60, env=self.env)
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip().splitlines()
            raise SlurmDaemonsError(f"{command[0]} did not start: {said[-1] if said else f'exit {done.returncode}'}")

    def states(self) -> dict[str, str]:
        """Each node's state as sinfo shows it (idle, alloc, drain, down*, ...)."""
        done = subprocess.run(
            [_binary("sinfo"), "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=30, env=self.env
        )
        return dict(line.split() for line in done.stdout.splitlines() if len(line.split()) == 2)

    def _await_idle(self) -> None:
        deadline = time.monotonic() + START_SECONDS
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = self.states()
            if all(states.get(node) == "idle" for node in self.node_names):
                return
            time.sleep(0.2)  # sinfo asks slurmctld; the nodes register within seconds
        logs = self.folder / "log"
        raise SlurmDaemonsError(f"the nodes did not come up within {START_SECONDS:g} s ({states}); see {logs}")

    def kill_slurmd(self, node: str) -> None:
        """A node dies, as far as Slurm can tell: its slurmd is SIGKILLed (slurmctld marks the node not
        responding once SlurmdTimeout passes). Its job steps' processes are the caller's to kill."""
        pid_file = self.folder / "run" / f"slurmd-{node}.pid"
        try:
            os.kill(int(pid_file.read_text().split()[0]), signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            pass

    def kill_node(self, node: str, sig: signal.Signals = signal.SIGKILL) -> list[int]:
        """A node dies whole: its slurmd is SIGKILLed and every process of its job steps (each carries
        SLURMD_NODENAME=node and this cluster's SLURM_CONF, its forks too) gets `sig` at once: SIGKILL
        (returns once they are gone), or SIGSTOP for a node that hangs, its sockets left open so
        that no peer learns of it; returns their pids."""
        self.kill_slurmd(node)
        marks = {b"SLURMD_NODENAME=" + node.encode(), b"SLURM_CONF=" + str(self.conf).encode()}
        doomed = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                environ = set((entry / "environ").read_bytes().split(b"\0"))
            except OSError:
                continue  # gone, or a kernel thread
            if marks <= environ:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(entry.name), sig)
                doomed.append(int(entry.name))
        if sig != signal.SIGKILL:
            return doomed
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in doomed) and time.monotonic() < deadline:
            time.sleep(0.01)
        return doomed

    def restart_slurmd(self, node: str) -> None:
        """The node's slurmd starts again (a repaired node); an admin or `lazarus pool return` resumes it."""
        self._run("slurmd", "-f", str(self.conf), "-N", node)

    def reset(self) -> None:
        """Every job cancelled and every node back in service (its slurmd running, resumed), as
        after a clean start: what one test did to the cluster does not reach the next."""
        for node in self.node_names:
            if not _alive_pid_file(self.folder / "run" / f"slurmd-{node}.pid"):
                self.restart_slurmd(node)
        subprocess.run([_binary("scancel"), "--full", "--user=root"], capture_output=True, timeout=60, env=self.env)
        for node in self.node_names:
            subprocess.run(
                [_binary("scontrol"), "update", f"nodename={node}", "state=resume"],
                capture_output=True,
                timeout=60,
                env=self.env,
            )
        self._await_idle()

    def stop(self) -> None:
        """Stop every daemon of the cluster (by the pids they recorded) and wait until they are gone."""
        run = self.folder / "run"
        for node in self.node_names:
            self._kill(run / f"slurmd-{node}.pid", "slurmd")
        self._kill(run / "slurmctld.pid", "slurmctld")
        self._kill(self.munge_home / "key" / "munged.pid", "munged")
        shutil.rmtree(self.munge_home, ignore_errors=True)  # its key goes with it

    @staticmethod
    def _kill(pid_file: Path, name: str) -> None:
        """SIGTERM the process `pid_file` names if it is `name` (a recycled pid is left alone), then
        wait for it to go (SIGKILL after 10 s)."""
        try:
            pid = int(pid_file.read_text().split()[0])
            command = Path(f"/proc/{pid}/comm").read_text().strip()
        except (OSError, ValueError, IndexError):
            return
        if command != name:
            return
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while _alive(pid):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                deadline = float("inf")
            time.sleep(0.05)
        pid_file.unlink(missing_ok=True)


def _alive_pid_file(pid_file: Path) -> bool:
    """Whether the process a pid file names runs."""
    try:
        return _alive(int(pid_file.read_text().split()[0]))
    except (OSError, ValueError, IndexError):
        return False


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, waiting for a parent that is not this process, counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def main(argv: list[str] | None = None) -> int:
    """`up` starts a cluster in --folder, `down` stops it."""
    parser = argparse.ArgumentParser(
        prog="python -m lazarus.infra.harness.slurm_daemons", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument("--folder", default=".lazarus/slurm", help="where the cluster keeps its files")
    parser.add_argument("--nodes", type=int, default=5, help="nodes node-0.. (default 5: 4 active and a spare)")
    args = parser.parse_args(argv)
    cluster = SlurmDaemons(Path(args.folder).resolve(), args.nodes)
    try:
        if args.action == "down":
            cluster.stop()
            print(f"stopped the Slurm cluster in {cluster.folder}")
            return 0
        cluster.start()
    except SlurmDaemonsError as error:
        print(f"slurm_daemons: {error}", file=sys.stderr)
        return 1
    print(f"Slurm cluster up: nodes {', '.join(cluster.node_names)}; export SLURM_CONF={cluster.conf}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
