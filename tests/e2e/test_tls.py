"""The CLI and `lazarus worker` against a Temporal frontend behind TLS and behind mutual TLS (haproxy
in front of the dev server, tests/support/tls.py), configured by the LAZARUS_TEMPORAL_TLS_*
settings alone; and every TLS mistake said in one line that names what to check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import pytest_asyncio
import yaml

from lazarus.infra.harness.temporal_server import local_environment
from tests.support.runs import SMALL_SPEC
from tests.support.tls import INSTALL_HINT, Certificates, TLSProxy, haproxy, make_certificates, openssl
from tests.support.waiting import wait_until
from tests.support.workers import lazarus_env

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

TLS_VARIABLES = ("CA", "CERT", "KEY", "SERVER_NAME")


def lazarus(env: dict, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run `python -m lazarus.cli ARGS` in `env` to its end."""
    return subprocess.run(
        [sys.executable, "-m", "lazarus.cli", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def tls_env(base: dict, address: str, **tls: Path | str) -> dict:
    """`base` pointed at `address`, with exactly the TLS settings given (ca=..., cert=..., key=...)."""
    env = {k: v for k, v in base.items() if not k.startswith("LAZARUS_TEMPORAL_TLS_")}
    env["LAZARUS_TEMPORAL_ADDRESS"] = address
    env.update({f"LAZARUS_TEMPORAL_TLS_{name.upper()}": str(value) for name, value in tls.items()})
    return env


def assert_one_line_error(done: subprocess.CompletedProcess, *fragments: str) -> str:
    """The command failed with one `lazarus: error:` line on stderr holding every fragment, and no traceback."""
    assert done.returncode != 0, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    line = done.stderr.strip()
    assert line.startswith("lazarus: error: ") and "\n" not in line, done.stderr
    for fragment in fragments:
        assert fragment in line, line
    return line


@pytest.fixture(scope="module")
def certificates(tmp_path_factory) -> Certificates:
    """The module's CAs and certificates; the module skips where openssl or haproxy is missing."""
    if openssl() is None:
        pytest.skip("openssl is not installed (apt-get install openssl)")
    if haproxy() is None:
        pytest.skip(INSTALL_HINT)
    return make_certificates(tmp_path_factory.mktemp("certificates"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def frontend(certificates, tmp_path_factory):
    """One dev server for the module, plain gRPC on a loopback port (the proxies' upstream)."""
    env = await local_environment(tmp_path_factory.mktemp("temporal") / "temporal.db")
    try:
        yield env
    finally:
        await env.shutdown()


def _proxy(folder: Path, frontend, certificates: Certificates, mutual: bool):
    upstream = frontend.client.service_client.config.target_host
    proxy = TLSProxy(folder, upstream, certificates.server, certificates.ca if mutual else None)
    try:
        yield proxy.start()
    finally:
        proxy.stop()


@pytest.fixture(scope="module")
def tls_proxy(frontend, certificates, tmp_path_factory):
    """haproxy terminating TLS in front of the dev server."""
    yield from _proxy(tmp_path_factory.mktemp("tls-proxy"), frontend, certificates, mutual=False)


@pytest.fixture(scope="module")
def mtls_proxy(frontend, certificates, tmp_path_factory):
    """haproxy terminating mutual TLS (client certificates signed by the test CA) in front of the dev server."""
    yield from _proxy(tmp_path_factory.mktemp("mtls-proxy"), frontend, certificates, mutual=True)


def short_spec(folder: Path) -> Path:
    """tests/specs/small.yaml cut to 10 steps on 2 nodes, no spare, cold starts: a run of seconds."""
    spec = yaml.safe_load(SMALL_SPEC.read_text())
    spec["trainer"].update(steps=10, checkpoint_every=5)
    spec["layout"]["dp"] = 2
    spec["cluster"].update(active_nodes=2, spare_nodes=0, warm_standby=False)
    path = folder / "short.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.parametrize("variant", ["tls", "mtls"])
def test_a_run_through_the_tls_frontend(variant, request, frontend, certificates, home, workers, tmp_path):
    proxy = request.getfixturevalue(f"{variant}_proxy")
    settings = {"ca": certificates.ca}
    if variant == "mtls":
        # Verified by name (the certificate's DNS entry) rather than by the dialled address.
        settings.update(cert=certificates.client_cert, key=certificates.client_key, server_name="localhost")
    env = tls_env(lazarus_env(frontend, home, f"tls-{uuid.uuid4().hex[:6]}"), proxy.address, **settings)
    log = tmp_path / "worker.log"
    worker = workers(env, log)

    def worker_connected():
        assert worker.process.poll() is None, log.read_text()
        return "worker pid" in log.read_text()

    wait_until(worker_connected, f"the worker to connect through {proxy.address}", timeout=60)
    run_id = f"tls-{variant}-{uuid.uuid4().hex[:6]}"
    started = lazarus(env, "run", "start", str(short_spec(tmp_path)), "--run-id", run_id)
    assert started.returncode == 0, started.stderr
    watched = lazarus(env, "run", "watch", run_id, timeout=150)
    assert watched.returncode == 0, watched.stdout + watched.stderr + log.read_text()
    shown = lazarus(env, "run", "status", run_id, "--json")
    assert shown.returncode == 0, shown.stderr
    status = json.loads(shown.stdout)
    assert (status["state"], status["step"]) == ("COMPLETED", 10)


def test_a_wrong_ca_is_named_by_the_cli_and_the_worker(tls_proxy, certificates, tmp_path):
    env = tls_env(dict(os.environ, LAZARUS_HOME=str(tmp_path)), tls_proxy.address, ca=certificates.other_ca)
    expected = (
        f"TLS with Temporal at {tls_proxy.address} failed: the server's certificate is not signed by the CA in "
        f"LAZARUS_TEMPORAL_TLS_CA ({certificates.other_ca}); check that this file is the CA"
    )
    assert_one_line_error(lazarus(env, "run", "status", "any-run"), expected)
    assert_one_line_error(lazarus(env, "worker"), expected)


# Under TLS 1.3 the server judges the client's certificate after the handshake, and its verdict
# reaches the client as an alert or as a closed connection: the message says what to set either way.
@pytest.mark.parametrize(
    "stranger, expected",
    [
        (False, "client certificate (mutual TLS); set LAZARUS_TEMPORAL_TLS_CERT and LAZARUS_TEMPORAL_TLS_KEY"),
        (True, "rejects the client certificate; check that LAZARUS_TEMPORAL_TLS_CERT ({cert}) is signed by a CA"),
    ],
    ids=["no-client-certificate", "client-certificate-of-another-ca"],
)
def test_mutual_tls_without_an_accepted_client_certificate(mtls_proxy, certificates, stranger, expected, tmp_path):
    settings = {"ca": certificates.ca}
    if stranger:
        settings.update(cert=certificates.stranger_cert, key=certificates.stranger_key)
    env = tls_env(dict(os.environ, LAZARUS_HOME=str(tmp_path)), mtls_proxy.address, **settings)
    assert_one_line_error(
        lazarus(env, "run", "status", "any-run"),
        f"TLS with Temporal at {mtls_proxy.address} failed: ",
        expected.format(cert=certificates.stranger_cert),
    )


def test_a_client_without_tls_is_told_to_set_it(tls_proxy, tmp_path):
    env = tls_env(dict(os.environ, LAZARUS_HOME=str(tmp_path)), tls_proxy.address)
    done = lazarus(env, "run", "status", "any-run")
    assert_one_line_error(done, f"Temporal at {tls_proxy.address} closed the connection", "LAZARUS_TEMPORAL_TLS_CA")


@pytest.mark.parametrize(
    "files, expected",
    [
        ({"ca": "missing/ca.pem"}, "LAZARUS_TEMPORAL_TLS_CA={tmp}/missing/ca.pem: no such file"),
        (
            {"cert": "client.pem", "key": "missing/client.key"},
            "LAZARUS_TEMPORAL_TLS_KEY={tmp}/missing/client.key: no such file",
        ),
        ({"key": "client.key"}, "LAZARUS_TEMPORAL_TLS_KEY is set but LAZARUS_TEMPORAL_TLS_CERT is not"),
        ({"ca": "notes.txt"}, "LAZARUS_TEMPORAL_TLS_CA={tmp}/notes.txt: not a PEM certificate"),
    ],
    ids=["missing-ca", "missing-key", "key-without-certificate", "ca-not-pem"],
)
def test_bad_tls_settings_fail_before_connecting(files, expected, tmp_path):
    (tmp_path / "client.pem").write_text("-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n")
    (tmp_path / "client.key").write_text("-----BEGIN PRIVATE KEY-----\n-----END PRIVATE KEY-----\n")
    (tmp_path / "notes.txt").write_text("not a certificate\n")
    # Nothing listens on port 1: the settings are judged before any connection is tried.
    env = tls_env(dict(os.environ), "127.0.0.1:1", **{name: tmp_path / path for name, path in files.items()})
    assert_one_line_error(lazarus(env, "run", "status", "any-run"), expected.format(tmp=tmp_path))
