"""Declared work: how many tokens a peer's payload may claim before we doubt it
(docs/architecture.md §13, "Declared tokens").

A payload declares the tokens its round trained, and the mean weighs it by them (capped at the
group's median, outer/aggregate.py). Whether we *believe* a declaration is decided here: against
what the peer's own published records have shown a round of it trains, and against our own round,
which no peer writes. A doubted peer's work still made the mean (every member computes the same
one), but it does not prove the peer (trust/proofs.py), so its claims win it no say in barrier,
state or NoLoCo decisions.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from diloco_node.lru import LRUSet, trim_oldest

# A payload may declare up to this many times the tokens its sender's own records say it trains in a
# round before we doubt it: an owner who stops using their machine makes it honestly faster from one
# round to the next, by as much as the 4× between a busy and an idle consumer GPU
# (docs/architecture.md §13, "Declared tokens").
CLAIM_SLACK = 4.0
# ... and never more than this many times what our own round trained, which we measured ourselves: a
# peer's records are its own word (a liar whose records said 1e15 was never doubted). Far above any
# honest spread of one run's machines (a GPU beside a CPU node), far below a lie that matters.
PEER_SPEEDUP = 64.0


class DeclaredWork:
    """Declared tokens judged against what each peer's own published records say a round of it
    trains (docs/architecture.md §13, "Declared tokens"): the most they have shown us, since a node
    its owner stops using speeds up honestly (a slowed or frozen round's record shows little), and against our own round
    (PEER_SPEEDUP), which no peer writes. Bounded: the MAX_PEERS peers seen last are remembered (the
    round loop shows it only the peers of its groups; 1,025 fresh ids wiped the whole table)."""

    MAX_PEERS = 1024

    def __init__(self) -> None:
        # peer → the most tokens a round of it trains, by its records; peers we doubted in the log already
        self.most: OrderedDict[str, float] = OrderedDict()
        self.said = LRUSet(self.MAX_PEERS)

    def saw(self, allowances: Mapping[str, object]) -> None:
        """Take in what each peer's latest record says a round of it trains (tokens; None: unknown)."""
        for peer, tokens in allowances.items():
            if isinstance(tokens, (int, float)) and math.isfinite(tokens) and tokens > self.most.get(peer, 0.0):
                self.most[peer] = float(tokens)
            if peer in self.most:
                self.most.move_to_end(peer)
        trim_oldest(self.most, self.MAX_PEERS)

    def doubted(self, declared: Mapping[str, float], own: float | None = None) -> dict[str, float]:
        """Those of `declared` (peer → the tokens its payload declared) beyond CLAIM_SLACK × the most
        its records have shown, or beyond PEER_SPEEDUP × `own` (the tokens of our own round), each
        with the bound it broke. A peer whose records show nothing yet (its first round) is judged
        by our round only. The mean is not changed by this (members read records at different
        moments, so a bound from them would split φ; the token cap at the group's median bounds the
        mean): the round loop leaves a doubted peer unproven and says so once."""
        doubted = {}
        for peer, tokens in declared.items():
            bounds = [CLAIM_SLACK * self.most[peer]] if self.most.get(peer, 0.0) > 0 else []
            bounds += [PEER_SPEEDUP * own] if own else []
            if bounds and tokens > min(bounds):
                doubted[peer] = min(bounds)
        return doubted

    def credible(self, group: Sequence[str], declared: Mapping[str, float], stats: Mapping[str, Mapping[str, Any]],
                 seconds: float | None, own: float) -> tuple[list[str], dict[str, float]]:
        """The members of a round's `group` whose checked work proves them (trust/proofs.py): the
        group less the peers whose payloads `declared` more tokens than their own records (`stats`,
        each peer's published stats) say a round of them trains: under --round-seconds (`seconds`,
        the round's budget) their tokens per compute second times it, under a fixed H their last
        round's tokens (H, batch and sequence length are each node's own), or more than
        PEER_SPEEDUP × `own`, what our round trained. With the peers doubted for the first time,
        each with the bound it broke, for the caller to say once. A doubted peer's work still made
        the mean, as on every member, but does not prove it. A round with no declarations (alone,
        held, or a butterfly member: its part's owner capped the tokens) proves its whole group."""
        if not declared:
            return list(group), {}
        allowances: dict[str, object] = {}
        for peer, shown in stats.items():
            if peer not in group:  # records are free: only our group's are remembered
                continue
            rate, tokens = shown.get("last_round_tokens_per_second"), shown.get("last_round_tokens")
            allowances[peer] = (rate * seconds if isinstance(rate, (int, float)) else None) if seconds else tokens
        self.saw(allowances)
        doubted = self.doubted(declared, own)
        first = {peer: bound for peer, bound in doubted.items() if self.first_doubt(peer)}
        return [peer for peer in group if peer not in doubted], first

    def first_doubt(self, peer: str) -> bool:
        """Whether `peer`'s claims are doubted for the first time (a liar repeats itself every round)."""
        if peer in self.said:
            return False
        self.said.add(peer)
        return True
