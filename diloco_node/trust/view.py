"""The run as we believe it: which peers decide the barrier, "behind" and the state we take, whom
the barrier waits for and whom we matchmake with (docs/architecture.md §9).

A `RunView` is one look at the run's records (read by swarm/presence.py, which keeps them fresh and
waits on them) together with what we proved (trust/proofs.py): who we are, the peers proven to us,
the `--peers` anchors. Every question here is answered from that look alone, so presence asks and
acts (waits, logs, re-syncs) and never judges a record itself. `round_state` and `moved_on` are the
barrier's verdicts on the records that decide.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from diloco_node.round import Outcome
from diloco_node.trust import proofs
from diloco_node.trust.records import NodeRecord, canonical_digest


def round_state(others: Collection[NodeRecord], round_: int, counted: Collection[str] | None = None,
                newcomers: Collection[str] = ()) -> Outcome:
    """Where `others` stand on `round_`: behind (most of the counted ones already exchanged it, so
    the run went on without us), alone (none is left in it), together (all the counted ones and the
    `newcomers` finished their inner phase of it) or waiting.

    `counted`: the peers whose records decide (proofs.counted; None: all). Any peer can publish
    records claiming a far-ahead round, which would make us drop our work and re-sync, or one that
    never becomes ready, which would hold the barrier for the round timeout: only proven peers
    decide and are waited for (and newcomers, once, see proofs.py). Unproven peers that are ready
    still take part in the round's matchmaking."""
    if moved_on(proofs.deciding(others, counted), round_):
        return Outcome.BEHIND
    # a record already past `round_` that never finished its inner phase (a joiner that entered
    # later, a node that re-synced past it) takes no part in it: nothing to wait or matchmake for
    others = [r for r in others if not r.round > round_ > r.ready_round]
    if not others:
        return Outcome.ALONE
    waited = [r for r in others if counted is None or r.peer_id in counted or r.peer_id in newcomers]
    if all(r.ready_round >= round_ for r in waited):
        return Outcome.TOGETHER
    return Outcome.WAITING


def moved_on(others: Collection[NodeRecord], round_: int) -> bool:
    """Whether more than half of `others` have exchanged `round_`."""
    return most(others, lambda r: r.exchanged_round >= round_)


def most(others: Collection[NodeRecord], holds: Callable[[NodeRecord], bool]) -> bool:
    """Whether more than half of `others` say what `holds` asks of a record."""
    return 2 * sum(holds(r) for r in others) > len(others)


@dataclass(frozen=True)
class Partners:
    """Whom a round matchmakes with once its barrier is passed (`RunView.partners`): the transport
    acts on it, and says what `respared` and `skipped` stand for once each."""

    outcome: Outcome  # the barrier's, or ALONE when nobody is left to matchmake with
    among: tuple[str, ...] | None  # NoLoCo: the partners kept; None: whoever is ready (DiLoCo)
    spare: bool = False  # matchmade for under the round's spare key
    respared: bool = False  # every drawn partner was dropped: the spare key is tried with `among`
    unproven: bool = False  # no counted peer about (before any proof: no anchor that is a node)
    strangers: bool = False  # ... nor a newcomer in its first round
    skipped: bool = False  # strangers only, and the last matchmaking with them found nobody: alone


@dataclass(frozen=True)
class RunView:
    """One look at the run: `found`, the live records of nodes with our config (ourselves
    included), judged as `me`, with `proven` peers and `anchors` (trust/proofs.py)."""

    me: str
    proven: frozenset[str]
    anchors: frozenset[str]
    found: dict[str, NodeRecord]

    def deciding(self) -> dict[str, NodeRecord]:
        """The live records that decide: those of counted peers (all before any proof), ourselves excluded."""
        return self._of(proofs.counted(self.proven, self.anchors, self.found))

    def state_sources(self) -> dict[str, NodeRecord]:
        """The live records that choose and serve the state we download (proofs.state_sources:
        the deciding ones, or in a fresh run our anchors), ourselves excluded."""
        return self._of(proofs.state_sources(self.proven, self.anchors, self.found))

    def unanchored(self) -> bool:
        """Whether the records choosing our state are every record (proofs.state_sources: no proof
        of ours, no `--peers` naming a node of the run) while other nodes are about."""
        return any(p != self.me for p in self.found) and \
            proofs.state_sources(self.proven, self.anchors, self.found) is None

    def present(self) -> int:
        """How many nodes --min-peers sees (ourselves included): once any proof exists (ours, or a
        joiner's anchors', proofs.counted) only the counted peers; before, every record."""
        who = proofs.counted(self.proven, self.anchors, self.found)
        return len(self.found) if who is None else 1 + len(who.intersection(self.found) - {self.me})

    def all_past(self, round_: int) -> bool:
        """Whether every other live node that decides has already exchanged `round_` (so we are behind them)."""
        others = self.deciding().values()
        return bool(others) and all(r.exchanged_round >= round_ for r in others)

    def ahead_of(self, round_: int) -> bool:
        """Whether most other live nodes that decide have already exchanged `round_` (we are behind)."""
        return moved_on(list(self.deciding().values()), round_)

    def past_inner_phase(self, round_: int) -> bool:
        """Whether most other live nodes that decide have already ended their inner phase of `round_`
        (announced ready for it): under --round-seconds its deadline has passed for the run."""
        return most(list(self.deciding().values()), lambda r: r.ready_round >= round_)

    def waited_for(self, others: dict[str, NodeRecord], round_: int, among: Collection[str] | None,
                   memory: proofs.Proofs) -> tuple[set[str] | None, set[str], set[str]]:
        """Whose records decide and are waited for up to the timeout (proofs.counted; NoLoCo's drawn
        group `among`: those of it proofs.trusted); the newcomers waited for in `round_` for their
        grace: unproven peers that took the state of a counted peer or ours (its record vouches for
        them) and are at `round_`, each in one round only (`memory`, our Proofs: Proofs.newcomers);
        and the strangers, NoLoCo's other drawn partners, waited for a shorter grace. `others`: the
        records the barrier looks at (of `among`, ourselves excluded)."""
        vouchers = proofs.counted(self.proven, self.anchors, self.found)
        # before any proof, those our anchors or we served: every record is waited for then, but a
        # newcomer's first round is still one worth matchmaking for (strangers_only)
        vouched = proofs.vouched_by(self.found, (vouchers or proofs.known((), self.anchors, self.found)) | {self.me})
        candidates = [p for p in vouched if p in others and (vouchers is None or p not in vouchers)
                      and (others[p].round == round_ or others[p].ready_round >= round_)]
        newcomers = memory.newcomers(candidates, round_)
        if vouchers is None:  # before any proof every record counts, a drawn group whole (proofs.py)
            return (None if among is None else set(among)), set(), set()
        counted = vouchers if among is None else \
            set(among) & (vouchers | proofs.endorsed(vouchers, self.found))  # proofs.trusted
        newcomers -= counted
        strangers = set() if among is None else {p for p in others if p not in counted and p not in newcomers}
        return counted, newcomers, strangers

    def strangers_only(self, granted: Collection[str]) -> bool:
        """Whether none of the other live records is of a peer worth a matchmaking window: counted
        (before any proof: an anchor that is a node of the run, proofs.known) or one of the
        newcomers `granted` their first round. A record that copies an honest one is ready whenever
        it is and never matchmakes: with only such records about, matchmakings are spaced out
        (proofs.Proofs.may_matchmake_strangers)."""
        expected = proofs.known(self.proven, self.anchors, self.found) | set(granted)
        return not any(p in expected for p in self.found if p != self.me)

    def drawn_partners(self, round_: int, among: Collection[str]) -> list[str]:
        """Those of NoLoCo's drawn partners `among` worth matchmaking with once the barrier is
        passed: the trusted ones (proofs.trusted; all before any proof), and the others that are
        ready for `round_`. A forged record drawn with us is thus never matchmade for. A partner
        whose record already trains a later round is not either: it averaged `round_` without us
        (NoLoCo marks no exchanged round), and matchmaking for it would only wait out its timeout,
        twice (seen when two nodes' views of the records differed and so did their draws)."""
        found = self.found
        trusted = proofs.trusted(self.proven, self.anchors, found)
        return [p for p in among if not (p in found and found[p].round > round_)
                and (trusted is None or p in trusted or (p in found and found[p].ready_round >= round_))]

    def spare_partners(self, round_: int, groups: list[list[str]]) -> list[str]:
        """NoLoCo: whom we matchmake with once more, under the round's spare key, when every drawn
        partner of ours was dropped (`drawn_partners` kept none): the peers we trust
        (proofs.trusted) that are at `round_` and, as we see the run, were drawn only with peers
        that are neither trusted by us nor ready, so they will have dropped theirs too. Forged
        records dilute the draws (an honest partner with probability (h − 1)/(h + k − 1)); here
        the honest nodes they left partnerless find each other (docs/architecture.md §9). Empty
        before any proof (a drawn group then counts whole, nobody is dropped) and when no such
        peer exists. A trusted odd one out of the draw (a group of one) is one too: it looks for
        spare partners itself (swarm/presence.py's `odd_spare_partners`)."""
        found = self.found
        trusted = proofs.trusted(self.proven, self.anchors, found)
        if trusted is None:
            return []

        def kept(peer: str) -> bool:  # what drawn_partners keeps, as far as we can see it
            record = found.get(peer)
            return record is not None and record.round <= round_ and \
                (peer in trusted or record.ready_round >= round_)

        spare = []
        for group in groups:
            if self.me in group:
                continue
            for peer in group:
                record = found.get(peer)
                if peer in trusted and record is not None and record.round == round_ and \
                        not any(kept(other) for other in group if other != peer):
                    spare.append(peer)
        return spare

    def partners(self, round_: int, outcome: Outcome, among: Collection[str] | None, spare: bool,
                 groups: Callable[[], list[list[str]]], memory: proofs.Proofs) -> Partners:
        """Whom to matchmake with in `round_` after a barrier that said `outcome`, for the drawn
        partners `among` (NoLoCo; None: DiLoCo, whoever is ready), `spare` when they are already the
        odd one out's spare partners. NoLoCo: a drawn partner we have no proof for and that is not
        ready was not waited for, and is not matchmade for either (`drawn_partners`); with none
        left, the trusted peers forged records left partnerless as well (`spare_partners`, of the
        round's drawn `groups`) are met under the spare key. DiLoCo: with no counted peer about nor
        a newcomer (strangers only), a round matchmakes only when our proof memory (`memory`,
        Proofs.may_matchmake_strangers) says the last such matchmaking did not find nobody."""
        respared = False
        if among and not spare and outcome in (Outcome.TOGETHER, Outcome.TIMEOUT):
            drawn = among
            among = self.drawn_partners(round_, drawn)
            if drawn and not among:
                among = self.spare_partners(round_, groups())
                spare = respared = bool(among)
            outcome = outcome if among else Outcome.ALONE
        # no counted peer about (before any proof: no anchor), nor (strangers) a newcomer
        unproven = among is None and outcome in (Outcome.TOGETHER, Outcome.TIMEOUT) and self.strangers_only(())
        strangers = unproven and self.strangers_only(memory.granted(round_))
        skipped = strangers and not memory.may_matchmake_strangers(round_)
        return Partners(Outcome.ALONE if skipped else outcome, None if among is None else tuple(among), spare,
                        respared, unproven, strangers, skipped)

    def diverged(self, round_: int, digest: str, among: Collection[str], served: bool = False) -> bool:
        """Whether our φ differs from the canonical φ for the start of `round_` of `among`, the
        group we averaged that round with (ourselves included); `served`: whether the state we
        serve, settled up to `round_`, differs from the one the group serves (overlapped modes).

        φ can split when an exchange fails on one side only (one node got the other's payload,
        the other did not); the nodes holding a non-canonical φ re-sync. Only the group's records
        count: records of peers that averaged nothing with us, which anyone can publish in any
        number, cannot outvote the group and make us drop our φ.
        """
        group = [r for p, r in self.found.items() if p in among]
        canonical = canonical_digest(group, round_, served)
        return canonical is not None and digest != canonical

    def _of(self, who: Collection[str] | None) -> dict[str, NodeRecord]:
        """The records of `who` (all when None), ourselves excluded."""
        return {p: r for p, r in self.found.items() if p != self.me and (who is None or p in who)}


def fetch_refusal(peer: str, group: Collection[str] | None, verified: Callable[[], bool],
                  vouched_by_member: Callable[[], bool]) -> str | None:
    """Why `peer` may not fetch our payload, an averaged part or push to us for a round whose group
    (ourselves included) is `group` (None: not known yet); None when it may. Before the group is
    known: any verified node of the run (`verified`: its record, or we served it our state), since
    our matchmaking may still run or have failed on one side only. Once it is known: its members,
    and joiners a member vouched for (`vouched_by_member`: they complete rounds their server had in
    flight). The two questions are asked only when needed: each may read the DHT."""
    if group is None:
        return None if verified() else "not a verified node of this run"
    if peer in group or vouched_by_member():
        return None
    return "not a member of the round's group"


def catch_up_refusal(group: Collection[str], bound: int, strangers: Callable[[], Collection[str]]) -> str | None:
    """Why a joiner may not complete a round from the group its state's server names for it (the
    server's word alone); None when it may. The group may be no larger than the run's groups
    (`bound`: NoLoCo's --group-size, else the most a config lets a run ask), and when its members'
    payloads are fetched (all-gather), each is then decoded at once: every member must be a node
    of the run we know (`strangers`: strangers_in over our records; asked only after the bound,
    since it may read the DHT). A butterfly round's parts come from the server alone, so there the
    bound is all (a member that left since does not matter)."""
    if len(group) > bound:
        return f"names a group of {len(group)}, more than this run's {bound}"
    if unknown := strangers():
        return f"names {len(unknown)} peer(s) that are no nodes of this run we know"
    return None


def strangers_in(group: Collection[str], me: str, known: Callable[[str], bool]) -> list[str]:
    """The members of a group, us aside, that are no nodes of the run we know (`known`: a verified
    record of this run, live or left within its time to live). We average with no group that has
    one, however it reached us (hivemind's matchmaking admits anyone, a peer may name any group):
    each member's payload would be taken into our mean."""
    return [peer for peer in group if peer != me and not known(peer)]
