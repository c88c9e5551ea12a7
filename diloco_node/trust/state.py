"""Whose state to take: a state download's server, its metadata and the rounds it may name,
judged against the run's records (docs/architecture.md §9, the state download; §14, catching up).

swarm/statesync.py downloads, serves and checks φ's digest; which records choose the state is
trust/view.py's (`RunView.state_sources`) and which state they agree on trust/records.py's
(`reference_state`). Here: in which order the servers are asked (`servers_in_order`), what of a
server's metadata outside the digest is believed (`metadata_refusal`), the distinct states the
records announce (`announced_states`), when a server may name the rounds a state is caught up
on (`catch_up_target`), and whether a downloaded state is the run's (`state_refusal`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from diloco_node.trust.records import MAX_ROUND, NodeRecord

# A state the run has moved past while it downloaded (rounds shorter than the download) is caught up
# on from the means of the rounds since (docs/architecture.md §14) when it is at most this many
# rounds behind (payload servers keep their offers about that long, swarm/exchange.py)
CATCH_UP_ROUNDS = 10
# How far a served round may lead the records: a record lags its node by the rounds it ran between
# announcing and our read (a solo node of a test runs several a second), a lie of 10^30 does not
MAX_ROUNDS_AHEAD = 16
MAX_ROUNDS_IN_FLIGHT = 8  # above what any server holds (outer/state.py checks the exact bound)
# How long a joiner waits for two nodes to announce the same state before taking one unchecked:
# a few rounds, for nodes one round apart to meet
AGREEMENT_WAIT_SECONDS = 30.0


def lower_median(rounds: Sequence[int]) -> int:
    ordered = sorted(rounds)
    return ordered[(len(ordered) - 1) // 2]


def metadata_refusal(metadata: Any, server: str, others: dict[str, NodeRecord]) -> str | None:
    """Why a state's metadata (outside φ's digest) is not taken from `server`, checked against the
    run's records `others`; None when it may be. The server must name itself (the joiner completes
    the rounds in flight from the group of the server named), and its round and rounds in flight
    must be ones the records show: no more than MAX_ROUNDS_AHEAD past the furthest record of the
    other nodes (the server's own, when it is alone: its own record cannot vouch for it otherwise)."""
    if not isinstance(metadata, dict):
        return "malformed metadata"
    if metadata.get("server") != server:
        return f"it names another server ({str(metadata.get('server'))[:60]!r})"
    round_, in_flight = metadata.get("round"), metadata.get("in_flight", [])
    if isinstance(round_, bool) or not isinstance(round_, int) or not 0 <= round_ <= MAX_ROUND:
        return f"malformed round {str(round_)[:20]!r}"
    if not (isinstance(in_flight, list) and len(in_flight) <= MAX_ROUNDS_IN_FLIGHT
            and all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < round_ for r in in_flight)):
        return "malformed rounds in flight"
    if not isinstance(metadata.get("has_momentum", False), bool):
        return "malformed momentum flag"
    if server not in others:
        return "it has no record in the run"
    shown = max((r.round for p, r in others.items() if p != server), default=others[server].round)
    if round_ > shown + MAX_ROUNDS_AHEAD:
        return f"its round {round_} is far ahead of the run's records (round {shown})"
    return None


def announced_states(others: Iterable[NodeRecord]) -> set[tuple[int, str]]:
    """The distinct (settled round, digest) states `others` announce serving."""
    return {(r.served_round, r.served_digest) for r in others if r.served_digest}


def servers_in_order(others: dict[str, NodeRecord], reference: tuple[int, str] | None) -> list[str]:
    """Whom to ask for the run's state, in order: the nodes serving the state most of the run
    announces, then the others, furthest round first; a record further ahead than
    MAX_ROUNDS_AHEAD past what most nodes announce comes last (anyone can announce a huge round
    to be asked first)."""
    shown = lower_median([r.round for r in others.values()]) if others else 0

    def order(peer: str) -> tuple[bool, bool, int, str]:
        record = others[peer]
        ahead = record.round > shown + MAX_ROUNDS_AHEAD
        return (record.served_round, record.served_digest) != reference, ahead, -min(record.round, shown), peer

    return sorted(others, key=order)


def catch_up_target(got: tuple[int, str], reference: tuple[int, str] | None, server: NodeRecord | None) -> int | None:
    """The settled round to catch a downloaded state up to, from `got` (its settled round and
    digest): the run's (`reference`, what the records agree on) when the state is 1 …
    CATCH_UP_ROUNDS rounds older and its server (`server`, its record) announces the run's state
    itself, so that the rounds between are ones it averaged and their groups are its to name. None
    when it is not to be caught up: current, newer, too far behind, or the run agrees on nothing."""
    if reference is None or server is None or (server.served_round, server.served_digest) != reference:
        return None
    return reference[0] if 0 < reference[0] - got[0] <= CATCH_UP_ROUNDS else None


def state_refusal(got: tuple[int, str], reference: tuple[int, str] | None, served: Sequence[int],
                  waited: float) -> str | None:
    """Why a downloaded state (`got`: its settled round and digest) is not to be taken, None when it
    is: it is the state the records agree on (`reference`); or no two nodes agreed on any after
    `waited` > AGREEMENT_WAIT_SECONDS seconds and it is not one every server has moved past (the
    rounds the records serve: `served`), so it is taken unchecked (the caller says so)."""
    if got == reference:
        return None
    if reference is None and waited > AGREEMENT_WAIT_SECONDS and got[0] >= min(served, default=got[0]):
        return None
    wanted = "no state two nodes agree on" if reference is None else \
        f"settled round {reference[0]}, digest {reference[1]}"
    return f"its state (settled round {got[0]}, digest {got[1]}) is not the run's ({wanted})"
