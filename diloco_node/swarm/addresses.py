"""Multiaddr validation, kept in swarm/ with the rest of what speaks hivemind's addresses.

config/ checks --peer, --listen and --announce with it through registry.MULTIADDR_CHECK.
"""

from hivemind.utils.multiaddr import Multiaddr

from diloco_node import registry


def check_multiaddr(value: str) -> None:
    """Raise ValueError with a one-line reason when `value` is not a well-formed multiaddr."""
    try:
        Multiaddr(value)
    except Exception as exc:  # the parser raises several unrelated types for garbage input
        raise ValueError(f"malformed multiaddr '{value}': {exc}") from None


registry.MULTIADDR_CHECK.declare(check_multiaddr)
