"""Settings read from the environment, shared by the CLI, the worker and the demo."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

ENV_ADDRESS = "LAZARUS_TEMPORAL_ADDRESS"
"""Temporal frontend host:port (default 127.0.0.1:7233)."""
ENV_NAMESPACE = "LAZARUS_NAMESPACE"
"""Temporal namespace (default: default)."""
ENV_TASK_QUEUE = "LAZARUS_TASK_QUEUE"
"""Task queue of the Lazarus worker (default: lazarus)."""
ENV_HOME = "LAZARUS_HOME"
"""State folder: runs, the pool, the dev server's database (default: ./.lazarus). On Slurm, a path every
node shares."""
ENV_UI_URL = "LAZARUS_UI_URL"
"""Web UI base URL for links (default: http://<host>:<port+1000> of the Temporal address)."""
ENV_TLS_CERT = "LAZARUS_TEMPORAL_TLS_CERT"
"""Client certificate for mutual TLS (PEM file); any TLS variable set connects with TLS."""
ENV_TLS_KEY = "LAZARUS_TEMPORAL_TLS_KEY"
"""Client key for mutual TLS (PEM file)."""
ENV_TLS_CA = "LAZARUS_TEMPORAL_TLS_CA"
"""The Temporal server's CA (PEM file); any TLS variable set connects with TLS."""
ENV_TLS_SERVER_NAME = "LAZARUS_TEMPORAL_TLS_SERVER_NAME"
"""Server name for SNI and the certificate check (default: the address's host)."""
ENV_BACKEND = "LAZARUS_BACKEND"
"""`lazarus worker --backend`'s default: local, kubernetes or slurm (default: local)."""
ENV_METRICS_PORT = "LAZARUS_METRICS_PORT"
"""`lazarus worker --metrics-port`'s default: serve Prometheus metrics on this port (default: off)."""
ENV_METRICS_ADDRESS = "LAZARUS_METRICS_ADDRESS"
"""`lazarus worker --metrics-address`'s default: the address the metrics server binds (default: 127.0.0.1)."""
ENV_KUBE_QPS = "LAZARUS_KUBE_QPS"
"""`lazarus worker --kube-qps`'s default: Kubernetes API requests a second, at most (default: 100)."""
ENV_KUBE_BURST = "LAZARUS_KUBE_BURST"
"""`lazarus worker --kube-burst`'s default: Kubernetes API requests at once before pacing (default: 200)."""
ENV_QUERY_SECONDS = "LAZARUS_QUERY_SECONDS"
"""How long a status or a control waits for the run's worker to answer before it reads the history
instead (seconds; default 3): what a command costs in the minute after a worker died."""
ENV_RUNS = "LAZARUS_RUNS"
"""The folder of the runs' directories (default: LAZARUS_HOME/runs). Workers on several machines, each
with a LAZARUS_HOME of its own, share one (a path every worker and node mounts)."""
ENV_STORE = "LAZARUS_STORE"
"""Where the state runs and controllers share lives (the node pool, runs' owners): a sqlite:///PATH or
postgresql://USER@HOST:PORT/DATABASE URL (default: sqlite:///<LAZARUS_HOME>/lazarus.db). Workers on
several machines share one PostgreSQL database."""
ENV_SLURM_CONF = "SLURM_CONF"
"""Slurm's own: the slurm.conf of the cluster the Slurm backend drives (default: Slurm's)."""

HELP = f"""environment:
  {ENV_ADDRESS}   Temporal frontend host:port (default 127.0.0.1:7233)
  {ENV_NAMESPACE}          Temporal namespace (default: default)
  {ENV_TASK_QUEUE}         task queue of the Lazarus worker (default: lazarus)
  {ENV_HOME}               state folder: runs, dev server database (default: ./.lazarus)
  {ENV_RUNS}               the runs' directories, shared by a fleet's workers (default: LAZARUS_HOME/runs)
  {ENV_STORE}              the shared state's database: sqlite:///PATH.db (one machine) or
                             postgresql://USER@HOST:PORT/DB (several) (default: LAZARUS_HOME/lazarus.db)
  {ENV_UI_URL}             web UI base URL for links (default: http://<host>:<port+1000>)
  {ENV_TLS_CA}, {ENV_TLS_CERT}, {ENV_TLS_KEY}
                             server CA, and for mutual TLS client certificate and key (PEM files):
                             any of them set connects with TLS
  {ENV_TLS_SERVER_NAME}
                             server name for SNI and the certificate check (default: the address's host)
"""


@dataclass(frozen=True)
class Settings:
    """Where Temporal is and where Lazarus keeps its state."""

    address: str = "127.0.0.1:7233"
    namespace: str = "default"
    task_queue: str = "lazarus"
    home: Path = Path(".lazarus")
    store: str | None = None  # the store's URL (LAZARUS_STORE); None: SQLite in the home
    runs: Path | None = None  # the runs' directories (LAZARUS_RUNS); None: home/runs
    ui_url: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    tls_server_name: str | None = None

    @classmethod
    def from_environ(cls, environ=os.environ) -> Settings:
        return cls(
            address=environ.get(ENV_ADDRESS, cls.address),
            namespace=environ.get(ENV_NAMESPACE, cls.namespace),
            task_queue=environ.get(ENV_TASK_QUEUE, cls.task_queue),
            home=Path(environ.get(ENV_HOME, cls.home)),
            store=environ.get(ENV_STORE) or None,
            runs=Path(environ[ENV_RUNS]) if environ.get(ENV_RUNS) else None,
            ui_url=environ.get(ENV_UI_URL),
            # An empty value means unset: `VAR= lazarus ...` turns TLS off rather than naming file ''.
            tls_cert=environ.get(ENV_TLS_CERT) or None,
            tls_key=environ.get(ENV_TLS_KEY) or None,
            tls_ca=environ.get(ENV_TLS_CA) or None,
            tls_server_name=environ.get(ENV_TLS_SERVER_NAME) or None,
        )

    @property
    def runs_folder(self) -> Path:
        """Where the runs' directories are: LAZARUS_RUNS, else the home's runs/."""
        return self.runs if self.runs is not None else self.home / "runs"

    def workflow_url(self, workflow_id: str) -> str:
        """Link to a run's history in the Temporal web UI."""
        base = self.ui_url
        if base is None:
            host, _, port = self.address.rpartition(":")
            base = f"http://{host}:{int(port) + 1000}" if port.isdigit() else "http://127.0.0.1:8233"
        return f"{base.rstrip('/')}/namespaces/{self.namespace}/workflows/{workflow_id}"
