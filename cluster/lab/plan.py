"""A lab's names, addresses and the `ip` commands that make and unmake it: pure, tested alone.

Host i (1..N) is the network namespace ``tfl-<id>-h<i>`` with ``eth0`` at
``<prefix>.<i>/24``; its peer ``tfl<id>h<i>`` sits on the bridge ``tfl<id>br`` in the
machine's own namespace, which holds ``<prefix>.254``: the operator's laptop on the same
network. Interface names stay within Linux's 15 characters (IFNAMSIZ - 1). A second bridge,
``tfl<id>bx``, holds the hosts cut off as a group (`isolate`): they see each other and
nobody else, and the laptop keeps a route to each of them through it, so producers still
reach both sides of a split.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from runtime.errors import TierflowError

__all__ = ["LAPTOP_HOST", "MAX_HOSTS", "LabPlan", "LabPlanError"]

MAX_HOSTS = 16
LAPTOP_HOST = 254  # the machine's own address on the lab's network: <prefix>.254
_ID = re.compile(r"^[a-z0-9]{1,6}$")
_PREFIX = re.compile(r"^10\.(\d{1,3})\.(\d{1,3})$")

Command = list[str]


class LabPlanError(TierflowError, ValueError):
    """A lab that cannot be made as asked; the message says why."""


@dataclass(frozen=True)
class LabPlan:
    """Names and addresses of one lab: `lab_id` (1-6 of a-z, 0-9), `hosts` hosts, addresses
    `prefix`.1 .. `prefix`.N (a private /24 under 10/8, e.g. ``10.213.0``)."""

    lab_id: str
    hosts: int
    prefix: str = "10.213.0"

    def __post_init__(self) -> None:
        if not _ID.match(self.lab_id):
            raise LabPlanError(f"lab id {self.lab_id!r}: 1 to 6 of a-z and 0-9")
        if not 1 <= self.hosts <= MAX_HOSTS:
            raise LabPlanError(f"hosts must be 1 to {MAX_HOSTS}, not {self.hosts}")
        m = _PREFIX.match(self.prefix)
        if m is None or not all(0 <= int(x) <= 255 for x in m.groups()):
            raise LabPlanError(f"prefix {self.prefix!r}: the first three parts of a 10.x.y.0/24")

    # ---- names and addresses ------------------------------------------------------------

    def host_names(self) -> list[str]:
        return [f"h{i}" for i in range(1, self.hosts + 1)]

    def index(self, host: str) -> int:
        if host not in self.host_names():
            raise LabPlanError(f"no host {host!r} in lab {self.lab_id} ({self.hosts} hosts)")
        return int(host[1:])

    def netns(self, host: str) -> str:
        return f"tfl-{self.lab_id}-h{self.index(host)}"

    def address(self, host: str) -> str:
        return f"{self.prefix}.{self.index(host)}"

    @property
    def laptop(self) -> str:
        return f"{self.prefix}.{LAPTOP_HOST}"

    @property
    def bridge(self) -> str:
        return f"tfl{self.lab_id}br"

    @property
    def cut_bridge(self) -> str:
        return f"tfl{self.lab_id}bx"

    def veth(self, host: str) -> str:
        """The laptop-side end of `host`'s cable (the host's own end is its eth0)."""
        return f"tfl{self.lab_id}h{self.index(host)}"

    def namespaces(self) -> list[str]:
        return [self.netns(h) for h in self.host_names()]

    # ---- commands -------------------------------------------------------------------------

    def up_commands(self) -> list[Command]:
        """Make the bridges, the laptop's address, then each host: namespace, cable, address,
        loopback. Run in order; `down_commands` undoes any prefix of them."""
        cmds: list[Command] = [
            ["ip", "link", "add", self.bridge, "type", "bridge"],
            ["ip", "addr", "add", f"{self.laptop}/24", "dev", self.bridge],
            ["ip", "link", "set", self.bridge, "up"],
            ["ip", "link", "add", self.cut_bridge, "type", "bridge"],
            ["ip", "link", "set", self.cut_bridge, "up"],
        ]
        for host in self.host_names():
            ns, veth = self.netns(host), self.veth(host)
            cmds += [
                ["ip", "netns", "add", ns],
                ["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns],
                ["ip", "link", "set", veth, "master", self.bridge],
                ["ip", "link", "set", veth, "up"],
                ["ip", "-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0"],
                ["ip", "-n", ns, "link", "set", "eth0", "up"],
                ["ip", "-n", ns, "link", "set", "lo", "up"],
            ]
        return cmds

    def down_commands(self) -> list[Command]:
        """Delete every namespace (its cable goes with it) and both bridges; each may
        already be gone, so the runner ignores their failures."""
        cmds: list[Command] = [["ip", "netns", "delete", ns] for ns in self.namespaces()]
        cmds += [["ip", "link", "delete", self.bridge], ["ip", "link", "delete", self.cut_bridge]]
        return cmds

    def link_commands(self, host: str, up: bool) -> list[Command]:
        """`host`'s own link down (a partition: packets vanish, connections time out rather
        than reset) or up again."""
        state = "up" if up else "down"
        return [["ip", "-n", self.netns(host), "link", "set", "eth0", state]]

    def isolate_commands(self, group: Sequence[str]) -> list[Command]:
        """Move `group`'s cables to the cut bridge: the group sees only itself; the laptop
        keeps a host route to each member through the cut bridge (both sides of a split
        take writes from producers)."""
        cmds: list[Command] = []
        for host in group:
            cmds.append(["ip", "link", "set", self.veth(host), "master", self.cut_bridge])
            cmds.append(
                ["ip", "route", "replace", f"{self.address(host)}/32", "dev", self.cut_bridge]
                + ["src", self.laptop]
            )
        return cmds

    def rejoin_commands(self, group: Sequence[str]) -> list[Command]:
        cmds: list[Command] = []
        for host in group:
            cmds.append(["ip", "route", "delete", f"{self.address(host)}/32"])
            cmds.append(["ip", "link", "set", self.veth(host), "master", self.bridge])
        return cmds

    def exec_prefix(self, host: str) -> Command:
        """The argv prefix that runs a command inside `host`."""
        return ["ip", "netns", "exec", self.netns(host)]
