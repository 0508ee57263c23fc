"""A Temporal frontend behind TLS for tests: certificates made with openssl, and haproxy terminating
TLS (or mutual TLS) on a loopback port in front of the dev server's gRPC port.

haproxy, not stunnel: gRPC clients (the SDK's core, tonic over rustls) insist on HTTP/2 chosen by
ALPN during the handshake, and Debian's stunnel (5.68) cannot answer ALPN at all, so the core
drops every connection to it with H2NotNegotiated. haproxy's `alpn h2` answers it.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from lazarus.infra.backend import free_port
from lazarus.infra.harness.temporal_server import port_answers
from tests.support.waiting import wait_until

INSTALL_HINT = (
    "haproxy is not installed: the project's set-up (`make setup`, `make test`) installs it as root with "
    "apt-get; elsewhere `sudo apt-get install haproxy`"
)


def haproxy() -> str | None:
    """Path of haproxy, None where it is not installed (it lives in /usr/sbin, off a user's PATH)."""
    found = shutil.which("haproxy")
    if found:
        return found
    return "/usr/sbin/haproxy" if os.access("/usr/sbin/haproxy", os.X_OK) else None


def openssl() -> str | None:
    """Path of the openssl command, None where it is not installed."""
    return shutil.which("openssl")


@dataclass(frozen=True)
class Certificates:
    """PEM files of one test module: a CA with a server and a client certificate, and a second CA
    unrelated to it, with a client certificate of its own (a stranger to the first CA)."""

    ca: Path
    server: Path  # certificate and key in one file, as haproxy reads them
    client_cert: Path
    client_key: Path
    other_ca: Path
    stranger_cert: Path
    stranger_key: Path


def _openssl(folder: Path, *args: str) -> None:
    done = subprocess.run([openssl(), *args], cwd=folder, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"openssl {' '.join(args)}: {done.stderr}"


def _config(folder: Path, name: str, common_name: str, extensions: str) -> Path:
    # A config file of our own: the system's openssl.cnf would add extensions of its choosing.
    path = folder / f"{name}.cnf"
    path.write_text(f"[req]\ndistinguished_name = dn\nprompt = no\n[dn]\nCN = {common_name}\n[ext]\n{extensions}\n")
    return path


def _authority(folder: Path, name: str) -> tuple[Path, Path]:
    key = folder / f"{name}.key"
    _openssl(folder, "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(key))
    config = _config(folder, name, name, "basicConstraints = critical,CA:TRUE\nkeyUsage = critical,keyCertSign,cRLSign")
    cert = folder / f"{name}.pem"
    _openssl(
        folder, "req", "-x509", "-new", "-key", str(key), "-config", str(config), "-extensions", "ext",
        "-days", "2", "-out", str(cert),
    )  # fmt: skip
    return cert, key


def _issue(folder: Path, name: str, authority: tuple[Path, Path], extensions: str) -> tuple[Path, Path]:
    key, request, cert = folder / f"{name}.key", folder / f"{name}.csr", folder / f"{name}.pem"
    _openssl(folder, "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(key))
    leaf = "basicConstraints = critical,CA:FALSE\nkeyUsage = critical,digitalSignature\n" + extensions
    config = _config(folder, name, name, leaf)
    _openssl(folder, "req", "-new", "-key", str(key), "-config", str(config), "-out", str(request))
    _openssl(
        folder, "x509", "-req", "-in", str(request), "-CA", str(authority[0]), "-CAkey", str(authority[1]),
        "-set_serial", str(secrets.randbits(63)), "-days", "2", "-extfile", str(config), "-extensions", "ext",
        "-out", str(cert),
    )  # fmt: skip
    return cert, key


def make_certificates(folder: Path) -> Certificates:
    """A CA, a server certificate for 127.0.0.1 and localhost, a client certificate, and an unrelated
    CA with its own client certificate, all under `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    ca, other = _authority(folder, "test-ca"), _authority(folder, "other-ca")
    server_cert, server_key = _issue(
        folder, "server", ca, "extendedKeyUsage = serverAuth\nsubjectAltName = IP:127.0.0.1,DNS:localhost"
    )
    bundle = folder / "server-bundle.pem"
    bundle.write_bytes(server_cert.read_bytes() + server_key.read_bytes())
    client = _issue(folder, "client", ca, "extendedKeyUsage = clientAuth")
    stranger = _issue(folder, "stranger", other, "extendedKeyUsage = clientAuth")
    return Certificates(ca[0], bundle, *client, other[0], *stranger)


class TLSProxy:
    """haproxy on 127.0.0.1 in the foreground, terminating TLS with `server_pem` and passing the
    bytes to `upstream` (host:port); with `client_ca`, only clients whose certificate it signed
    get through (mutual TLS)."""

    def __init__(self, folder: Path, upstream: str, server_pem: Path, client_ca: Path | None = None):
        self.folder, self.upstream, self.server_pem, self.client_ca = folder, upstream, server_pem, client_ca
        self.process: subprocess.Popen | None = None
        self.port = 0
        folder.mkdir(parents=True, exist_ok=True)

    @property
    def address(self) -> str:
        """host:port a client connects to."""
        return f"127.0.0.1:{self.port}"

    def _config(self) -> Path:
        verify = f" ca-file {self.client_ca} verify required" if self.client_ca else ""
        path = self.folder / "haproxy.cfg"
        path.write_text(
            "global\n"
            f"    pidfile {self.folder / 'haproxy.pid'}\n"
            "    log stderr format raw local0 info\n"
            "defaults\n"
            "    mode tcp\n    log global\n    option tcplog\n"
            # Long client and server timeouts: a worker's long poll stays open for a minute.
            "    timeout connect 5s\n    timeout client 10m\n    timeout server 10m\n"
            "frontend temporal\n"
            f"    bind 127.0.0.1:{self.port} ssl crt {self.server_pem} alpn h2{verify}\n"
            "    default_backend dev_server\n"
            "backend dev_server\n"
            f"    server dev {self.upstream}\n"
        )
        return path

    def start(self, attempts: int = 3) -> TLSProxy:
        """Start haproxy and wait until its port accepts connections (fresh ports if one is taken)."""
        for attempt in range(1, attempts + 1):
            self.port = free_port()
            log = open(self.folder / "haproxy.log", "ab")
            self.process = subprocess.Popen(
                [haproxy(), "-db", "-f", str(self._config())], stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )
            log.close()
            if wait_until(self._listening_or_gone, f"haproxy to listen on {self.address}", timeout=30) == "up":
                return self
            # Exited: a port taken between its choice and haproxy's bind is the one cause worth a retry.
            if "cannot bind" not in self.log() or attempt == attempts:
                break
        raise AssertionError(f"haproxy exited with code {self.process.returncode}:\n{self.log()}")

    def _listening_or_gone(self) -> str | None:
        if self.process.poll() is not None:
            return "gone"
        return "up" if port_answers("127.0.0.1", self.port) else None

    def log(self) -> str:
        """What haproxy wrote (its start-up complaints, one line per connection)."""
        return (self.folder / "haproxy.log").read_text(errors="replace")

    def stop(self) -> None:
        """End the haproxy we started (by its pid) and reap it."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
