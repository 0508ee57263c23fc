"""The fixtures tests share (loaded as a pytest plugin: pyproject.toml's `-p tests.support.fixtures`).

Every one that starts something stops it at teardown, pass or fail.
"""

from __future__ import annotations

import multiprocessing
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest
from kubernetes import client as k8s

from lazarus.infra import processes, standbys
from lazarus.infra.backends.local.cluster import LocalCluster
from lazarus.infra.backends.slurm.cluster import SlurmCluster
from lazarus.infra.harness import postgres
from lazarus.infra.harness.slurm_daemons import SlurmDaemons, why_not_startable
from tests.k8s.emulator import BACKEND_USER_AGENT, EmulatorThread
from tests.k8s.kubelet import FakeKubelet
from tests.support import forks
from tests.support.backends import Harness
from tests.support.kubernetes import add_node, api_client
from tests.support.runs import SMALL_SPEC, kill_rank_processes, train_without_fault
from tests.support.workers import WorkerProcess


@pytest.fixture(scope="session", autouse=True)
def forked_nodes():
    """The local backend's launchers and standbys started in the test's own process are forked
    from the session's forkserver, torch already imported (tests/support/forks.py)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(processes, "start_in_session", forks.start_in_session)
        patch.setattr(standbys, "start_in_session", forks.start_in_session)
        yield
    # Multiprocessing joins its live children at exit: a process a failed test left must not hold it.
    for child in multiprocessing.active_children():
        child.kill()


@pytest.fixture
def home(tmp_path):
    """LAZARUS_HOME of one test; its rank processes are killed at teardown, pass or fail."""
    home = tmp_path / "lazarus-home"
    home.mkdir()
    yield home
    kill_rank_processes(home)


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """reference(spec_path) -> losses of that spec trained without a fault (once per session)."""
    cache: dict[Path, dict[int, float]] = {}

    def losses_of(spec_path: Path) -> dict[int, float]:
        if spec_path not in cache:
            cache[spec_path] = train_without_fault(tmp_path_factory.mktemp("reference"), spec_path)
        return cache[spec_path]

    return losses_of


@pytest.fixture(scope="session")
def reference_losses(reference) -> dict[int, float]:
    """Losses of the small spec trained once without any fault and without Temporal."""
    return reference(SMALL_SPEC)


@pytest.fixture
def workers():
    """Start workers with `workers(env, log, cwd=None)`; any still running at teardown is killed."""
    started: list[WorkerProcess] = []

    def start(env: dict, log: Path, cwd: Path | None = None) -> WorkerProcess:
        started.append(WorkerProcess(env, log, cwd))
        return started[-1]

    yield start
    for worker in started:
        worker.kill()


@pytest.fixture
def emulator():
    """kmock's emulator, extended (tests/k8s/emulator.py), on a free port of 127.0.0.1."""
    served = EmulatorThread().start()
    try:
        yield served
    finally:
        served.stop()


@pytest.fixture
def backend_api(emulator):
    """The client the backend uses (the emulator records its calls, for the RBAC check)."""
    return api_client(emulator.url, BACKEND_USER_AGENT)


@pytest.fixture
def clusters(backend_api):
    """Make KubernetesCluster(home) on the backend's client; each is closed (its watches stopped) at teardown."""
    from lazarus.infra.backends.kubernetes.cluster import KubernetesCluster

    made = []

    def make(home):
        made.append(KubernetesCluster(home, backend_api))
        return made[-1]

    try:
        yield make
    finally:
        for cluster in made:
            cluster.close()


@pytest.fixture
def admin(emulator):
    """The test's own client: it plays the cluster's administrator and its kubelets."""
    return k8s.CoreV1Api(api_client(emulator.url, "test-admin"))


@pytest.fixture
def confirming_kubelet(admin, tmp_path):
    """The fake kubelet of namespace lz without containers: it confirms the graceful deletion of
    pods on nodes not in its `dead` set (add a node to make its kubelet gone)."""
    kubelet = FakeKubelet(admin, "lz", tmp_path / "kubelet", run_containers=False).start()
    try:
        yield kubelet
    finally:
        kubelet.stop()


@pytest.fixture
def training_pool(admin, tmp_path):
    """Nodes worker-0..3 and spares spare-0..1 of pool `test`, their pods run by a fake kubelet
    (namespace lz); yields the kubelet, stopped (its processes killed) at teardown."""
    for i in range(4):
        add_node(admin, f"worker-{i}")
    for i in range(2):
        add_node(admin, f"spare-{i}", spare=True)
    kubelet = FakeKubelet(admin, "lz", tmp_path / "kubelet").start()
    try:
        yield kubelet
    finally:
        kubelet.stop()


@pytest.fixture
def local_backend(tmp_path):
    """The local backend as a Harness (cold starts: a spec's warm standbys are the local tests' own
    concern); every run it started is stopped at teardown."""
    cluster = LocalCluster(tmp_path)
    harness = Harness(
        "local", cluster, tmp_path, {"warm_standby": False}, ["node-0", "node-1"], ["node-2"], cluster.kill_node
    )
    try:
        yield harness
    finally:
        for run_id in harness.started:
            cluster.stop_run(run_id)


@pytest.fixture
def kubernetes_backend(admin, clusters, tmp_path):
    """The Kubernetes backend on the emulator as a Harness: nodes worker-0, worker-1 and the spare
    spare-0 of pool `test`, their pods run by a fake kubelet (stopped at teardown)."""
    for index, name in enumerate(["worker-0", "worker-1"]):
        add_node(admin, name, address=f"10.0.0.{index + 1}")
    add_node(admin, "spare-0", spare=True, address="10.0.1.1")
    kubelet = FakeKubelet(admin, "lz", tmp_path / "kubelet").start()
    # Rank pods (cold): the warm standby pods are tests/k8s/test_recovery.py's concern, and
    # these nodes' addresses are not this machine's for a standby to listen on.
    section = {
        "backend": "kubernetes",
        "warm_standby": False,
        "kubernetes": {"namespace": "lz", "pool": "test", "mount_path": str(tmp_path), "image": "trainer:test"},
    }

    def kill_node(run_id: str, node: str) -> None:
        kubelet.kill_node(node)

    try:
        yield Harness(
            "kubernetes",
            clusters(tmp_path),
            tmp_path,
            section,
            ["worker-0", "worker-1"],
            ["spare-0"],
            kill_node,
            kubelet=kubelet,
        )
    finally:
        kubelet.stop()


@pytest.fixture(scope="session")
def slurm_daemons():
    """A real Slurm cluster of 5 nodes (node-0..node-4) for the session, in a folder of its own,
    stopped at the end; the tests that take it skip, with the reason, where it cannot start."""
    reason = why_not_startable()
    if reason is not None:
        pytest.skip(reason)
    folder = Path(tempfile.mkdtemp(prefix="lazarus-slurm-"))
    daemons = SlurmDaemons(folder, nodes=5)
    try:
        daemons.start()
        yield daemons
    finally:
        daemons.stop()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def slurm_backend(slurm_daemons, tmp_path):
    """The Slurm backend on the real cluster as a Harness: a node dies as its slurmd and its steps'
    processes are SIGKILLed. At teardown every run is stopped, every job cancelled, and every node
    back in service, pass or fail."""
    cluster = SlurmCluster(tmp_path, environ=slurm_daemons.env)

    def kill_node(run_id: str, node: str) -> None:
        slurm_daemons.kill_node(node)

    # Cold launchers as job steps, as the other backends' suites run: the standby steps are
    # tests/slurm's concern (recovery, chaos) and `lazarus launch --backend slurm`'s.
    settings = {"backend": "slurm", "warm_standby": False}
    harness = Harness("slurm", cluster, tmp_path, settings, ["node-0", "node-1"], ["node-2"], kill_node)
    try:
        yield harness
    finally:
        for run_id in harness.started:
            cluster.stop_run(run_id)
        slurm_daemons.reset()


@pytest.fixture(params=["local", "kubernetes", "slurm"])
def backend(request):
    """Each backend in turn, as a Harness: tests that take it run once per backend."""
    return request.getfixturevalue(f"{request.param}_backend")


@pytest.fixture(scope="session")
def postgres_server():
    """A real PostgreSQL server for the session (infra/harness/postgres.py), in a folder of its own,
    stopped and deleted at the end; the tests that take it skip, with the reason, where it cannot start."""
    reason = postgres.why_not_startable()
    if reason is not None:
        pytest.skip(reason)
    folder = Path(tempfile.mkdtemp(prefix="lazarus-postgres-"))
    server = postgres.PostgresServer(folder, durable=False)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


def schema_of_its_own(server: postgres.PostgresServer) -> tuple[str, str]:
    """A new, empty schema of the server's database: (its name, the store URL whose connections use it)."""
    import psycopg

    name = f"t_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(server.url, autocommit=True) as connection:
        connection.execute(f"CREATE SCHEMA {name}")
    return name, f"{server.url}?options=-csearch_path%3D{name}"


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request, tmp_path):
    """The URL of an empty store of the test's own, on each engine in turn: a SQLite file in tmp_path,
    a schema of the session's PostgreSQL server (dropped at teardown)."""
    if request.param == "sqlite":
        yield f"sqlite:///{(tmp_path / 'lazarus.db').as_posix().lstrip('/')}"
        return
    import psycopg

    server = request.getfixturevalue("postgres_server")
    name, url = schema_of_its_own(server)
    yield url
    with psycopg.connect(server.url, autocommit=True) as connection:
        connection.execute(f"DROP SCHEMA {name} CASCADE")
