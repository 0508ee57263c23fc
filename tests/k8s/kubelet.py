"""The kubelets of the emulated nodes, played on this machine, so that rank pods really run.

Each pod bound to a live node runs as local processes: its container's command (`python` is this
interpreter) with its environment, plus a marker naming the kubelet and the pod. A `python -m`
command is forked from the session's forkserver, torch already imported (tests/support/forks.py): a
real cluster's nodes import it on cores of their own, in parallel, where this machine's two cores
would take 13 s of CPU for a pool's five standby pods. The marker plays the container's cgroup:
every process the container starts carries it, whatever session it makes (a warm standby forks
launchers that lead their own), and killing the pod kills them all. A process exec'd in the
container shows it in its environment; a forked one, whose environment in /proc is the forkserver's,
carries it as its name (its comm, which forks inherit). The kubelet reports the pod's phase to the
API; when a pod turns terminating (the emulator's graceful deletion), it kills the pod's processes
and confirms with a delete of grace 0, as a real kubelet does. A node that dies takes its processes
with it; a dead node's kubelet confirms nothing, so its pods stay until the API server learns of the
death (their phase turns Failed) or they are deleted with grace 0.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import threading
import uuid
from datetime import UTC, datetime
from pathlib import Path

from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from tests.support import forks

POD_MARKER = "FAKE_KUBELET_POD"
"""The environment variable that names the pod a process belongs to (the module docstring)."""


def process_name(marker: str) -> str:
    """The name (comm, at most 15 bytes) the forked processes of the container marked `marker` carry."""
    return "pod-" + hashlib.sha1(marker.encode()).hexdigest()[:11]


def container_processes(marker: str) -> list[int]:
    """The live processes started in the container marked `marker` (they carry it, in their
    environment or as their name); zombies are over and not counted."""
    name = process_name(marker).encode()
    marker_entry = f"{POD_MARKER}={marker}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as stat:
                head, tail = stat.read().rsplit(b")", 1)
            if tail.split()[0] == b"Z":
                continue
            if head.split(b"(", 1)[1] != name:
                with open(f"/proc/{entry.name}/environ", "rb") as environ:
                    if marker_entry not in environ.read().split(b"\0"):
                        continue
        except OSError:  # gone meanwhile, or another user's
            continue
        found.append(int(entry.name))
    return found


class FakeKubelet:
    """Runs the pods of namespace `namespace` on this machine (see the module docstring)."""

    def __init__(
        self,
        admin: k8s.CoreV1Api,
        namespace: str,
        logs: Path,
        interval: float = 0.05,
        run_containers: bool = True,
        confirm_after: float = 0.0,
    ):
        self.admin = admin
        self.confirm_after = confirm_after  # seconds a live kubelet takes to confirm a pod's deletion
        self.run_containers = run_containers  # False: only confirm deletions (pods stay as the test sets them)
        self.namespace = namespace
        self.logs = logs
        self.interval = interval
        self.processes: dict[str, subprocess.Popen | forks.ForkedProcess] = {}
        self.started: list[str] = []  # pod names, once per container start
        self.dead: set[str] = set()
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # Pods of two kubelets (two test processes, as pytest-xdist runs them) may share a name:
        # a container's marker names its kubelet too, so that a kill ends only this one's.
        self._marker_prefix = f"{uuid.uuid4().hex[:8]}/"
        self._thread = threading.Thread(target=self._loop, name="fake-kubelet", daemon=True)

    def start(self) -> FakeKubelet:
        self.logs.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                with self._lock:
                    self._sync()
            except BaseException as error:  # noqa: BLE001 - surfaced by the test through `errors`
                self.errors.append(error)

    def _patch(self, name: str, body: dict) -> None:
        with contextlib.suppress(ApiException):
            self.admin.patch_namespaced_pod(name, self.namespace, body)

    def _confirm_deletion(self, name: str) -> None:
        with contextlib.suppress(ApiException):  # 404: gone already
            self.admin.delete_namespaced_pod(name, self.namespace, grace_period_seconds=0)

    def _kill(self, name: str) -> None:
        process = self.processes.pop(name, None)
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)  # a fork killed before it made its session
            process.wait()
            # The rest of the container: processes in sessions of their own. Killed until none
            # is left, since one may fork while the scan runs.
            while pids := container_processes(self._marker_prefix + name):
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)

    def _sync(self) -> None:
        pods = {p.metadata.name: p for p in self.admin.list_namespaced_pod(self.namespace).items}
        for name in [n for n in self.processes if n not in pods]:
            self._kill(name)
        for name, pod in pods.items():
            if pod.spec.node_name in self.dead:
                continue
            phase = pod.status.phase if pod.status else None
            if pod.metadata.deletion_timestamp:
                self._kill(name)
                if (datetime.now(UTC) - pod.metadata.deletion_timestamp).total_seconds() >= self.confirm_after:
                    self._confirm_deletion(name)
            elif self.run_containers and name not in self.processes and phase in (None, "Pending"):
                self._run(pod)
            elif name in self.processes and self.processes[name].poll() is not None and phase == "Running":
                code = self.processes[name].returncode
                self._patch(name, {"status": {"phase": "Succeeded" if code == 0 else "Failed"}})

    def _run(self, pod: k8s.V1Pod) -> None:
        container = pod.spec.containers[0]
        command = [sys.executable if part == "python" else part for part in container.command[:1]] + container.command[
            1:
        ]
        marker = self._marker_prefix + pod.metadata.name
        env = {**os.environ, **{e.name: e.value for e in container.env or []}, POD_MARKER: marker}
        log_path = self.logs / f"{pod.metadata.name}.log"
        if command[0] == sys.executable and command[1:2] == ["-m"]:
            self.processes[pod.metadata.name] = forks.ForkedProcess(command, env, log_path, process_name(marker))
        else:
            self.processes[pod.metadata.name] = forks.REAL_START(command, env, log_path)
        self.started.append(pod.metadata.name)
        self._patch(pod.metadata.name, {"status": {"phase": "Running"}})

    def kill_node(self, node: str, api_learns: bool = True) -> None:
        """The node dies: its processes end; if `api_learns`, first its Ready turns Unknown and
        its pods Failed, as with a node problem detector or a fast node monitor.

        With `api_learns=False` the API server still shows the node Ready and its pods Running,
        as on a cluster with Kubernetes' default 40 s node-monitor grace: the survivors' errors
        are all there is to go by.
        """
        with self._lock:
            self.dead.add(node)
            pods = self.admin.list_namespaced_pod(self.namespace, field_selector=f"spec.nodeName={node}").items
            if api_learns:
                now = datetime.now(UTC).isoformat()
                self.admin.patch_node(
                    node,
                    {
                        "status": {
                            "conditions": [
                                {
                                    "type": "Ready",
                                    "status": "Unknown",
                                    "reason": "NodeStatusUnknown",
                                    "lastTransitionTime": now,
                                    "message": "Kubelet stopped posting node status.",
                                }
                            ]
                        }
                    },
                )
                for pod in pods:
                    self._patch(pod.metadata.name, {"status": {"phase": "Failed", "reason": "NodeLost"}})
            for pod in pods:
                self._kill(pod.metadata.name)

    def repair(self, node: str) -> None:
        """The node is repaired: its kubelet runs pods again and posts Ready."""
        with self._lock:
            self.dead.discard(node)
            condition = {"type": "Ready", "status": "True", "reason": "KubeletReady"}
            self.admin.patch_node(node, {"status": {"conditions": [condition]}})

    def stop(self) -> None:
        """Stop syncing and kill every process it started."""
        self._stop.set()
        self._thread.join(10)
        with self._lock:
            for name in list(self.processes):
                self._kill(name)
