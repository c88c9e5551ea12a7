"""Isolation: noticing that every peer has vanished, and dialing them until they are back.

A node is isolated when it has trained with peers and now sees none of them, and they did not
leave (a peer that leaves withdraws its record; one cut off or crashed just goes silent). It is
then no use training alone: its solo outer steps would only take its φ away from the swarm's (seen:
420 solo rounds in a 4-minute cut, issue 18). The round engine pauses while `since` is set; this
class dials the node's contacts with backoff meanwhile, and clears `since` once a peer is back.

The presence heartbeat thread feeds it (`observe`); the round engine asks `cut_off` between two
heartbeats, so the sets are guarded by `_lock`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from datetime import datetime

from diloco_node.lru import MAX_TRACKED_PEERS, trim_oldest
from diloco_node.swarm.contacts import Contacts

logger = logging.getLogger(__name__)

FIRST_DIAL_DELAY = 1.0
# a short cap: a node back on the network rejoins within a round or two (each try is a TCP probe
# per contact); at 5 s a 60-s cut's node took 12 s to notice the link was back (test_partition)
MAX_DIAL_DELAY = 2.0
REMEMBER_SECONDS = 30.0  # how often a connected node notes its peers' addresses
# How often an isolated node says it still is: a paused node that logs nothing looks hung, and one
# whose only peers crashed for good waits until its owner restarts it (a restart knows no peers,
# so it goes on alone once their records have expired)
REMIND_SECONDS = 600.0


class Isolation:
    def __init__(self, contacts: Contacts, run_id: str):
        self._contacts, self._run_id = contacts, run_id
        self._lock = threading.Lock()  # guards _known
        # peers we have seen live → whether they left on purpose since; the most recently seen
        # MAX_TRACKED_PEERS only: records are free, and fresh ids must not grow it without bound
        # (docs/architecture.md §9). Forgetting the least recent cannot hide a cut: the peers of our
        # last heartbeats are the newest.
        self._known: OrderedDict[str, bool] = OrderedDict()
        self._capacity = MAX_TRACKED_PEERS
        self.since: float | None = None  # wall time at which we lost the last peer; None: not isolated
        self.on_change: Callable[[float | None], None] | None = None
        self._dial_delay = FIRST_DIAL_DELAY
        self._next_dial = 0.0
        self._next_remember = 0.0
        self._next_remind = 0.0

    def observe(self, others: Collection[str], departed: Collection[str]) -> None:
        """One heartbeat's view: the other live nodes of the run, and those that left recently."""
        now = time.monotonic()
        with self._lock:
            for peer in departed:
                if peer in self._known:  # a peer we never saw live does not count either way
                    self._known[peer] = True
            for peer in others:
                self._known[peer] = False  # live (again: back after leaving)
                self._known.move_to_end(peer)
            trim_oldest(self._known, self._capacity)
        if others:
            if self.since is not None:
                logger.info("back in the swarm after %.0fs isolated: %d peer(s) reachable",
                            time.time() - self.since, len(others))
                self._set(None)
            if now >= self._next_remember:
                self._remember()
                self._next_remember = now + REMEMBER_SECONDS
            return
        if not self.cut_off(others):
            return  # alone because everyone else left: the run is ours to go on with
        if self.since is None:
            self._set(time.time())
            self._dial_delay, self._next_dial = FIRST_DIAL_DELAY, now
            self._next_remind = now + REMIND_SECONDS
            logger.warning("isolated: no peer of run %s reachable since %s; pausing training and retrying "
                           "our peers until one is back", self._run_id, datetime.now().strftime("%H:%M:%S"))
        elif now >= self._next_remind:
            self._next_remind = now + REMIND_SECONDS
            logger.warning("still isolated: no peer of run %s reachable for %.0f min; training stays paused "
                           "until one is back (if they are gone for good, restart this node to go on alone)",
                           self._run_id, (time.time() - self.since) / 60)
        if now >= self._next_dial:
            reached = self._dial()
            logger.debug("dialed contacts reached=%s next_in=%.0fs", reached, self._dial_delay)
            self._next_dial = time.monotonic() + self._dial_delay
            self._dial_delay = min(2 * self._dial_delay, MAX_DIAL_DELAY)

    def cut_off(self, others: Collection[str]) -> bool:
        """Whether seeing just `others` (the other live nodes) means we are cut off: none is left
        of the peers we knew, and not all of those left on purpose."""
        with self._lock:
            return not others and not all(self._known.values())

    def tracked(self) -> int:
        """How many peers the view remembers (bounded by MAX_TRACKED_PEERS)."""
        with self._lock:
            return len(self._known)

    def _set(self, since: float | None) -> None:
        self.since = since
        if self.on_change:
            self.on_change(since)

    def _remember(self) -> None:
        try:
            self._contacts.remember_connected()
        except Exception as exc:  # a failed lookup of our own connections is retried later
            logger.debug("could not list connected peers: %r", exc)

    def _dial(self) -> list[str]:
        try:
            return self._contacts.dial()
        except Exception as exc:
            logger.debug("dialing contacts failed: %r", exc)
            return []
