"""`roles.<role>.host` (runtime/binding.py): what a server binds and what it tells others."""

from __future__ import annotations

import pytest

from runtime.binding import Binding, check_host, resolve, url_host
from runtime.config import ConfigError, load

pytestmark = pytest.mark.unit


def _node() -> str:
    return "10.213.0.2"


def _never() -> str:
    raise AssertionError("the node's address was asked for a host that does not need it")


def test_node_binds_and_advertises_the_nodes_address() -> None:
    assert resolve("node", _node) == Binding("10.213.0.2", "10.213.0.2")


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::"])
def test_every_address_is_bound_and_the_nodes_is_advertised(wildcard: str) -> None:
    assert resolve(wildcard, _node) == Binding(wildcard, "10.213.0.2")


@pytest.mark.parametrize("host", ["127.0.0.1", "10.1.2.3", "gw.example.com", "::1"])
def test_a_given_address_is_bound_and_advertised_as_it_is(host: str) -> None:
    assert resolve(host, _never) == Binding(host, host)


@pytest.mark.parametrize("bad", ["", "bad host", "a..b", "x" * 300, "http://x"])
def test_a_host_that_is_no_address_is_refused_at_load(bad: str) -> None:
    assert check_host(bad) is not None
    with pytest.raises(ConfigError, match="roles.collector.host"):
        load(environ={"TIERFLOW_ROLES__COLLECTOR__HOST": bad or '""'})


def test_ipv6_hosts_are_bracketed_in_urls() -> None:
    assert url_host("::1") == "[::1]" and url_host("10.0.0.1") == "10.0.0.1"
