"""The one-line advice for a client without TLS that a TLS server turns away, for each way the SDK
reports the close (which one a connection gets depends on when haproxy's close lands)."""

import pytest

from lazarus.client.config import Settings
from lazarus.client.tls import describe_failure

_PREFIX = "Failed client connect: `get_system_info` call error after connection: "

# Seen against haproxy terminating TLS, from a plaintext client, in one sitting of 60 connects.
CLOSES = {
    "canceled": _PREFIX + 'Status { code: Cancelled, message: "operation was canceled", source: Some('
    'tonic::transport::Error(Transport, hyper::Error(Canceled, "connection closed"))) }',
    "broken-pipe": _PREFIX + 'Status { code: Unknown, message: "transport error", source: Some(tonic::transport::'
    "Error(Transport, hyper::Error(Io, Custom { kind: BrokenPipe, "
    'error: "stream closed because of a broken pipe" }))) }',
    "reset": _PREFIX + 'Status { code: Unknown, message: "transport error", source: Some(tonic::transport::'
    "Error(Transport, hyper::Error(Io, Kind(ConnectionReset)))) }",
}


@pytest.mark.parametrize("message", CLOSES.values(), ids=CLOSES.keys())
def test_a_close_after_connecting_tells_a_plain_client_to_set_the_ca(message):
    advice = describe_failure(message, Settings(address="127.0.0.1:7233"))
    assert advice is not None and advice.startswith("Temporal at 127.0.0.1:7233 closed the connection")
    assert "LAZARUS_TEMPORAL_TLS_CA" in advice


def test_a_refused_connection_is_not_taken_for_a_tls_server():
    refused = (
        "Failed client connect: Server connection error: tonic::transport::Error(Transport, ConnectError("
        'ConnectError("tcp connect error", Os { code: 111, kind: ConnectionRefused, message: "Connection refused" })))'
    )
    assert describe_failure(refused, Settings(address="127.0.0.1:7233")) is None
