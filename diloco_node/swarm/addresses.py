"""Multiaddr validation, kept here because swarm/ is the only package that imports hivemind."""

from hivemind.utils.multiaddr import Multiaddr


def check_multiaddr(value: str) -> None:
    """Raise ValueError with a one-line reason when `value` is not a well-formed multiaddr."""
    try:
        Multiaddr(value)
    except Exception as exc:  # the parser raises several unrelated types for garbage input
        raise ValueError(f"malformed multiaddr '{value}': {exc}") from None
