"""The detached dev server of `lazarus server --detach` and of the demo, and the first client of it."""

from __future__ import annotations

from pathlib import Path

import pytest

from lazarus.client.config import Settings
from lazarus.client.runs import connect, has_search_attributes
from lazarus.infra.backend import free_ports
from lazarus.infra.harness.temporal_server import start_detached, stop_detached

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


async def test_a_detached_server_serves_a_client_at_once_and_stops(tmp_path):
    """The demo connects the moment its server answers (lazarus.client.runs.connect waits out a
    frontend that is not healthy yet), and `lazarus server --stop` ends the server it recorded."""
    port, ui_port = free_ports(2)
    pid = start_detached(tmp_path, port, ui_port)
    try:
        client = await connect(Settings(address=f"127.0.0.1:{port}", home=tmp_path))
        assert await has_search_attributes(client, "default")
    finally:
        assert stop_detached(tmp_path) == pid
    assert not Path(f"/proc/{pid}").exists() and not (tmp_path / "server.pid").exists()
