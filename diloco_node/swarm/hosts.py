"""Which host a multiaddr names, and which group of hosts a stream's connection counts against.

A peer chooses its id for free, but not the address its connection comes from: that address is
the one thing that tells many fresh ids of one attacker apart from many peers. `host_of` is the
plain host (dial-back dials only the asker's own); `host_group` is the unit that stream limits
bound strangers by (docs/architecture.md §9): an IPv4 address, an IPv6 /48 (a site's allocation:
a subscriber given a /56 or a /64 cannot pick a fresh group per id within it), or the relay a
relayed connection comes through. A connection from our own machine (loopback) is in no group:
its peers are as trusted as the machine, and test swarms run there.
"""

from __future__ import annotations

import ipaddress

from hivemind.utils.multiaddr import Multiaddr

UNKNOWN_HOST = "unknown"  # an address we cannot read: all such streams share one group
IPV6_GROUP_BITS = 48


def _parts(address: object) -> list[tuple[str, str]]:
    try:
        return [(protocol.name, str(value)) for protocol, value in Multiaddr(str(address)).items()]
    except Exception:  # multiaddr raises its own errors on malformed text
        return []


def _relayed(parts: list[tuple[str, str]]) -> bool:
    return any(name == "p2p-circuit" for name, _ in parts)


def host_of(address: object) -> str | None:
    """The ip4/ip6 host of a multiaddr (text or Multiaddr); None for a relayed, DNS or malformed one."""
    parts = _parts(address)
    if _relayed(parts):
        return None
    return next((value for name, value in parts if name in ("ip4", "ip6")), None)


def host_group(address: object) -> str | None:
    """The group of hosts a connection from `address` counts against: its IPv4 address, its IPv6
    /48, the relay's group for a relayed one (`relay <group>`), UNKNOWN_HOST when there is none;
    None for our own machine (loopback, not relayed)."""
    parts = _parts(address)
    ip = next((value for name, value in parts if name in ("ip4", "ip6")), None)
    if ip is None:
        return UNKNOWN_HOST
    try:
        parsed = ipaddress.ip_address(ip)
    except ValueError:
        return UNKNOWN_HOST
    if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is not None:
        parsed = parsed.ipv4_mapped  # an IPv4 peer on a dual-stack socket: its own address, not one ::/48 for all
    relayed = _relayed(parts)
    if parsed.is_loopback and not relayed:
        return None
    group = str(ipaddress.ip_network(f"{parsed}/{IPV6_GROUP_BITS}", strict=False)) if parsed.version == 6 \
        else str(parsed)
    return f"relay {group}" if relayed else group
