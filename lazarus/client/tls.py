"""TLS to the Temporal frontend: the LAZARUS_TEMPORAL_TLS_* settings as the SDK's TLSConfig, and a
failed TLS connection said as what to fix.

The SDK's core (Rust: tonic over rustls) reports every failure to connect as one RuntimeError,
"Failed client connect: ...", with the transport's debug text inside; the names matched below
(UnknownIssuer, "received fatal alert: CertificateRequired", ...) are rustls's and tonic's.
"""

from __future__ import annotations

import re
from pathlib import Path

from temporalio.service import TLSConfig

from lazarus.client.config import ENV_TLS_CA, ENV_TLS_CERT, ENV_TLS_KEY, ENV_TLS_SERVER_NAME, Settings


class TLSSettingsError(ValueError):
    """A TLS setting that cannot work (a missing or unreadable file, a key without its certificate)."""


_PEM_CONTENT = {
    ENV_TLS_CA: (re.compile(rb"-----BEGIN CERTIFICATE-----"), "a PEM certificate (the server's CA)"),
    ENV_TLS_CERT: (re.compile(rb"-----BEGIN CERTIFICATE-----"), "a PEM certificate (the client's)"),
    ENV_TLS_KEY: (re.compile(rb"-----BEGIN [A-Z ]*PRIVATE KEY-----"), "a PEM private key"),
}


def uses_tls(settings: Settings) -> bool:
    """Whether any LAZARUS_TEMPORAL_TLS_* setting asks for TLS."""
    return any((settings.tls_ca, settings.tls_cert, settings.tls_key, settings.tls_server_name))


def _pem(variable: str, path: str | None) -> bytes | None:
    if not path:
        return None
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise TLSSettingsError(f"{variable}={path}: no such file") from None
    except OSError as error:
        raise TLSSettingsError(f"{variable}={path}: cannot read it ({error.strerror or error})") from None
    pattern, what = _PEM_CONTENT[variable]
    # Checked here: the core takes a file without a certificate for an empty CA list, and
    # its failure then is an unknown issuer (or a crash of the interpreter at exit).
    if not pattern.search(data):
        raise TLSSettingsError(f"{variable}={path}: not {what}")
    return data


def tls_config(settings: Settings) -> TLSConfig | bool:
    """The client's TLS: False without any TLS setting; else the CA, client certificate and key read
    and checked (a TLSSettingsError names the setting to fix)."""
    if not uses_tls(settings):
        return False
    if bool(settings.tls_cert) != bool(settings.tls_key):
        given, missing = (ENV_TLS_KEY, ENV_TLS_CERT) if settings.tls_key else (ENV_TLS_CERT, ENV_TLS_KEY)
        raise TLSSettingsError(
            f"{given} is set but {missing} is not: a client certificate (mutual TLS) needs both "
            "the certificate and its private key"
        )
    return TLSConfig(
        server_root_ca_cert=_pem(ENV_TLS_CA, settings.tls_ca),
        client_cert=_pem(ENV_TLS_CERT, settings.tls_cert),
        client_private_key=_pem(ENV_TLS_KEY, settings.tls_key),
        domain=settings.tls_server_name,
    )


# The server accepted the connection and then ended it before answering the first call; which of
# these the client sees depends on when the close lands (hyper says "ConnectionReset" without a space).
_CLOSED = re.compile(r"after connection.*(connection closed|broken pipe|connection ?reset)", re.IGNORECASE | re.DOTALL)
_ALERT = re.compile(r"received fatal alert: (\w+)")
_BAD_SERVER_CERTIFICATE = re.compile(r"InvalidCertificate\((\w+)")
_SERVER_NAME = re.compile(r'expected: \w+\(\\?"?([^"\\)]+)')


def describe_failure(message: str, settings: Settings) -> str | None:
    """One line that says what to fix when `message` (the SDK's "Failed client connect: ...") is a
    TLS failure, or a client without TLS turned away by a TLS server; None for anything else."""
    where = f"Temporal at {settings.address}"
    if not uses_tls(settings):
        if _CLOSED.search(message):
            return (
                f"{where} closed the connection without answering; if it expects TLS, set {ENV_TLS_CA} "
                f"(and for mutual TLS {ENV_TLS_CERT} and {ENV_TLS_KEY})"
            )
        return None
    problem = _server_side(message, settings) or _client_side(message, settings)
    return f"TLS with {where} failed: {problem}" if problem else None


def _server_side(message: str, settings: Settings) -> str | None:
    """What is wrong with the server's side of the handshake, as the client saw it."""
    if "UnknownIssuer" in message:
        if settings.tls_ca:
            return (
                f"the server's certificate is not signed by the CA in {ENV_TLS_CA} ({settings.tls_ca}); "
                "check that this file is the CA that issued the server's certificate"
            )
        return (
            f"the server's certificate is not signed by a CA this machine trusts; set {ENV_TLS_CA} "
            "to the CA file that issued it"
        )
    if "NotValidForName" in message:
        name = _SERVER_NAME.search(message)
        return (
            f"the server's certificate is not valid for the name {name.group(1) if name else 'dialled'}; "
            f"connect by a name or address the certificate carries, or set {ENV_TLS_SERVER_NAME} to one"
        )
    if bad := _BAD_SERVER_CERTIFICATE.search(message):
        return f"the server's certificate was rejected ({bad.group(1)}); check the server's certificate"
    if "H2NotNegotiated" in message:
        return (
            "the server did not negotiate HTTP/2 (ALPN h2), which gRPC needs; a TLS proxy in front "
            "of Temporal must offer ALPN h2"
        )
    if "InvalidContentType" in message or "CorruptMessage" in message:
        return "the server does not speak TLS; check the address, or unset the LAZARUS_TEMPORAL_TLS_* settings"
    return None


def _client_side(message: str, settings: Settings) -> str | None:
    """What the server made of the client's certificate (or of its absence)."""
    if "KeyMismatch" in message or "InconsistentKeys" in message:
        return f"{ENV_TLS_KEY} ({settings.tls_key}) is not the private key of the certificate in {ENV_TLS_CERT}"
    alert = _ALERT.search(message)
    if alert and alert.group(1) == "CertificateRequired":
        return (
            f"the server requires a client certificate (mutual TLS); set {ENV_TLS_CERT} and {ENV_TLS_KEY} "
            "to a certificate signed by a CA the server trusts and its private key"
        )
    # Under TLS 1.3 the server judges the client's certificate after the client's handshake is
    # done, so its verdict may come as an alert or as a connection it simply closes.
    if alert or _CLOSED.search(message):
        why = f" with the alert {alert.group(1)}" if alert else " after the TLS handshake"
        if settings.tls_cert:
            return (
                f"the server ended the connection{why}, as a server does that rejects the client certificate; "
                f"check that {ENV_TLS_CERT} ({settings.tls_cert}) is signed by a CA the server trusts"
            )
        return (
            f"the server ended the connection{why}, as a server does that requires a client certificate "
            f"(mutual TLS); set {ENV_TLS_CERT} and {ENV_TLS_KEY}"
        )
    return None
