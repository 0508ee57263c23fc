"""free_ports: ports a listener of another process opens later, kept out of the kernel's own picks."""

from __future__ import annotations

import socket

from lazarus.infra import backend


def test_ports_are_distinct_free_and_below_the_ephemeral_range(monkeypatch, tmp_path):
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("32768\t60999\n")
    monkeypatch.setattr(backend, "EPHEMERAL_RANGE", ranges)
    ports = backend.free_ports(20)
    assert len(set(ports)) == 20
    assert all(backend.LISTENER_FLOOR <= port < 32768 for port in ports)
    for port in ports:  # nothing listens there: each binds
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))


def test_a_port_something_listens_on_is_passed_over(monkeypatch):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        taken = listener.getsockname()[1]
        with socket.socket() as spare:
            spare.bind(("127.0.0.1", 0))
            free = spare.getsockname()[1]
        picks = iter([taken, taken])
        monkeypatch.setattr(backend, "_listener_range", lambda: (1024, 65536))
        monkeypatch.setattr(backend.random, "randrange", lambda first, last: next(picks, free))
        assert backend.free_ports(1) == [free]


def test_without_a_known_range_the_kernel_picks(monkeypatch, tmp_path):
    monkeypatch.setattr(backend, "EPHEMERAL_RANGE", tmp_path / "missing")
    assert backend._listener_range() == (0, 0)
    [port] = backend.free_ports(1)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))
