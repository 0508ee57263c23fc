"""The test and bench dev server survives a port taken between its choice and the server's bind."""

import socket

from lazarus.infra import backend
from lazarus.infra.harness import temporal_server
from lazarus.infra.harness.temporal_server import local_environment


async def test_dev_server_starts_on_fresh_ports_when_one_was_taken(monkeypatch):
    # The CI failure this guards against: the HTTP port chosen for the server was bound by
    # someone else before the server started, and the server exited.
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    real_free_ports = backend.free_ports
    chosen: list[list[int]] = []

    def ports_once_taken(count):
        ports = real_free_ports(count)
        if not chosen:
            ports[1] = taken.getsockname()[1]  # the HTTP port
        chosen.append(ports)
        return ports

    monkeypatch.setattr(backend, "free_ports", ports_once_taken)
    try:
        env = await local_environment()
        try:
            assert len(chosen) == 2
            assert await env.client.count_workflows() is not None
            assert temporal_server.port_answers("127.0.0.1", chosen[1][0])
        finally:
            await env.shutdown()
    finally:
        taken.close()
