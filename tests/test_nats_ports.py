"""A nats-server whose chosen port another process took before the bind starts anyway,
on ports chosen again; one given its ports explicitly fails with the server's reason."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

import runtime.nats as rn
from runtime.nats import NatsServer, NatsServerError

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def taken() -> Iterator[int]:
    """A port bound and listened on by this test: nobody else can bind it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_server_whose_chosen_port_was_taken_starts_on_new_ports(
    taken: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = rn.free_ports
    calls: list[int] = []

    def first_taken(n: int, host: str = "127.0.0.1") -> list[int]:
        calls.append(n)
        ports = real(n, host)
        return [taken, *ports[1:]] if len(calls) == 1 else ports  # lost the race once

    monkeypatch.setattr(rn, "free_ports", first_taken)
    server = NatsServer(store_dir=tmp_path / "n")
    try:
        server.start(timeout=20)
        assert server.running and server.port != taken
        assert len(calls) == 2
        assert rn.PORT_TAKEN in server.log_path.read_text()  # the first start did fail
    finally:
        server.stop()


def test_a_server_given_a_taken_port_fails_saying_so(taken: int, tmp_path: Path) -> None:
    server = NatsServer(store_dir=tmp_path / "n", port=taken)
    with pytest.raises(NatsServerError, match=rn.PORT_TAKEN):
        server.start(timeout=20)
    assert not server.running
