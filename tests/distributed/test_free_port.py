"""A port picked for a server that binds it later is one no outgoing connection can take in between
(`relax.distributed.process_group.free_port`)."""

from __future__ import annotations

import socket

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relax.distributed import process_group
from relax.distributed.process_group import QUIET_PORTS_FROM, ephemeral_port_range, free_port


def test_the_port_is_below_the_ephemeral_range_and_a_server_binds_it():
    low, _ = ephemeral_port_range()
    if low <= QUIET_PORTS_FROM:
        pytest.skip(f"this machine's ephemeral range starts at {low}")
    ports = {free_port() for _ in range(20)}
    assert all(QUIET_PORTS_FROM <= port < low for port in ports), ports
    for port in ports:
        with socket.create_server(("127.0.0.1", port)):
            pass


def test_outgoing_connections_never_land_on_a_picked_port():
    """Many client sockets (as a Ray cluster opens) take their local ports from the ephemeral range only, which
    the picked port lies below: the premise of `free_port`, checked on this machine's kernel."""
    low, high = ephemeral_port_range()
    picked = free_port()
    with socket.create_server(("127.0.0.1", 0), backlog=256) as server:
        target = server.getsockname()
        clients = [socket.create_connection(target) for _ in range(200)]
        try:
            local_ports = {client.getsockname()[1] for client in clients}
            assert all(low <= port <= high for port in local_ports), sorted(local_ports)[:5]
            assert picked not in local_ports
        finally:
            for client in clients:
                client.close()


def test_a_taken_port_is_not_picked(monkeypatch):
    """With the quiet range narrowed to one port a listener holds, the pick falls back to the OS's port."""
    with socket.create_server(("127.0.0.1", 0)) as holder:
        held = holder.getsockname()[1]
        monkeypatch.setattr(process_group, "QUIET_PORTS_FROM", held)
        monkeypatch.setattr(process_group, "ephemeral_port_range", lambda: (held + 1, 60999))
        assert free_port() != held


@settings(max_examples=25, deadline=None)
@given(st.integers(1024, 65535), st.integers(0, 2000))
def test_any_ephemeral_range_gives_a_bindable_port(low, width):
    """Whatever the machine's range, the port binds: one between the quiet start and the range when there is room
    (a few ports there, all held, is too unlikely to draw), else the OS's pick."""
    original = process_group.ephemeral_port_range
    process_group.ephemeral_port_range = lambda: (low, min(65535, low + width))
    try:
        port = free_port()
    finally:
        process_group.ephemeral_port_range = original
    assert 0 < port < 65536
    if low - QUIET_PORTS_FROM >= 100:
        assert QUIET_PORTS_FROM <= port < low
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))
