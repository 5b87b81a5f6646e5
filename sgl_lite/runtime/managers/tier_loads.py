"""Requests whose cacheable prefix continues on the disk tier wait here, outside the queue, while it loads.

A request arriving with more of its prefix on disk than the tree holds (`KVTier.loadable`: whole blocks, then a
partial last block it has every token of) is held: its matched prefix is locked (`req.tier_hold`, so the part the
load continues cannot be evicted meanwhile), fresh slots are allocated for the tokens the load adds (evicting as
any allocation does), and the tier's read threads read the blocks into them. Each step `collect` installs the
finished loads: the tokens inserted into the tree over those slots, the hold moved onto the new node; the
request then joins the queue and matches the whole prefix like any other. Admission drops the hold once its own
lock is taken (`ReqKV.start`); an abort drops it here, and its load's slots are freed once the read threads let
go of them. A load that fails part way installs the blocks before the failure; the request computes the rest.

Room: the slots of loads in flight and the prefixes installed and waiting for admission take at most half the
pool between them, so admission always has room; a load that does not fit waits for them, or for running
requests to finish, and the loads after it wait behind it (in arrival order). One that cannot find room while
nothing else runs or waits is dropped: the request computes its prefix as it would without the tier (and lets go
of its hold, which may be what fills the pool).

Holds are tree locks: the slot accounting (req_kv.py) counts them as protected tokens and the loads' slots as
`loading_tokens`; an idle scheduler holds none.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from sgl_lite.runtime.managers.policy import prefix_match_key
from sgl_lite.runtime.managers.req_kv import ReqKV
from sgl_lite.runtime.managers.request import Req
from sgl_lite.runtime.mem_cache.hicache.tier import KVTier, LoadTicket, StoredRun

logger = logging.getLogger(__name__)


class TierLoads:
    def __init__(self, tier: KVTier, kv: ReqKV, others_running: Callable[[], bool]) -> None:
        """`others_running()`: whether requests hold KV that finishing will free (else a load that does not
        fit never will)."""
        self.tier = tier
        self.kv = kv
        self.others_running = others_running
        self.loading: dict[Req, LoadTicket | None] = {}  # None: waiting for staging room
        self.abandoned: list[LoadTicket] = []  # loads of aborted requests, until their read thread lets go

    def __len__(self) -> int:
        return len(self.loading)

    def __contains__(self, req: Req) -> bool:
        return req in self.loading

    def has_work(self) -> bool:
        """Whether a request waits here or an aborted load still holds slots."""
        return bool(self.loading or self.abandoned)

    def any_ready(self) -> bool:
        """Whether `collect` has anything to do now (a server loop waits otherwise): a load ended, or loads wait
        for room while none is in flight (with one in flight, they wait for it to end rather than spin)."""
        in_flight = [t for t in (*self.loading.values(), *self.abandoned) if t is not None]
        if any(ticket.done.is_set() for ticket in in_flight):
            return True
        return not in_flight and None in self.loading.values()

    def hold_if_on_disk(self, req: Req) -> bool:
        """Start loading `req`'s prefix when the disk holds more of it than the tree; True when it did (the
        request is now this object's until `collect` returns it)."""
        tree = self.kv.tree_cache
        key = prefix_match_key(req)
        if tree.disable or not key or self.tier.store.num_blocks == 0:
            return False  # the cheap checks first: nothing on disk could continue this prefix
        match = tree.match_prefix(key)
        run = self.tier.loadable(key, match.length)
        if not run.keys:
            return False
        self.kv.hold(req, match.last_node)
        waiting = None in self.loading.values()  # loads waiting for room start first, in arrival order
        self.loading[req] = None
        if not waiting and self._start(req, key, run) is None:  # no room, nothing to wait for: computed without the tier
            del self.loading[req]
            return False
        return True

    def collect(self) -> list[Req]:
        """The held requests whose loads ended (installed or dropped), in arrival order; starts waiting loads."""
        for ticket in [t for t in self.abandoned if t.done.is_set()]:
            self.abandoned.remove(ticket)
            self._free_slots(ticket.slots)
            self.tier.finish_load(ticket, 0)
        ready, waiting = [], False
        for req, ticket in list(self.loading.items()):
            if ticket is None:
                if waiting:
                    continue  # an earlier load waits for room: later ones wait behind it
                key = prefix_match_key(req)
                started = self._start(req, key, self.tier.loadable(key, req.tier_hold.depth))
                waiting = started is False
                if started is not None:
                    continue
            elif ticket.done.is_set():
                self.tier.finish_load(ticket, self._install(req, ticket))
            else:
                continue
            del self.loading[req]
            ready.append(req)
        return ready

    def _start(self, req: Req, key: list[int], run: StoredRun) -> bool | None:
        """Allocate the slots of `run` past the hold and start its load (True); None: nothing to load, or no
        room while there is nothing to wait for (the hold released); False: the load waits for room."""
        first = req.tier_hold.depth
        count = run.end - first if run.keys else 0
        if count <= 0:
            return None
        # Loads in flight and loaded prefixes waiting for admission take at most half the pool, so admission
        # always has room (admitting them releases their holds; loads in flight always finish).
        held_by_loading = sum(r.tier_hold.depth for r in self.loading if r.tier_hold is not None and r is not req)
        pending = self.kv.held_tokens - req.tier_hold.depth - held_by_loading + self.kv.loading_tokens
        if pending and pending + count > self.kv.num_slots // 2:
            return False
        if not self.kv.ensure_free(count):
            if pending or self.others_running():
                return False
            logger.info("hierarchical cache: no room for %d loaded tokens of %s; they are recomputed", count, req.rid)
            self.kv.release_hold(req)
            return None
        slots = self.kv.allocator.alloc(count)
        assert slots is not None, "ensure_free promised the room"
        self.kv.loading_tokens += count
        self.loading[req] = self.tier.start_load(key, run, first, slots)
        return True

    def _install(self, req: Req, ticket: LoadTicket) -> int:
        """Put the loaded tokens into the tree over the ticket's slots and free the rest; the tokens installed."""
        end = ticket.loaded_end
        if end <= ticket.first:  # nothing past the hold was loaded
            self._free_slots(ticket.slots)
            return 0
        tree = self.kv.tree_cache
        key = prefix_match_key(req)[:end]
        match = tree.match_prefix(key)  # at least the held prefix; more if another request computed it meanwhile
        assert match.length >= ticket.first, "the held prefix was evicted"
        kept = ticket.slots[match.length - ticket.first : end - ticket.first]
        self._free_slots(ticket.slots[: match.length - ticket.first])
        self._free_slots(ticket.slots[end - ticket.first :])
        self.kv.loading_tokens -= kept.numel()
        if not kept.numel():
            return 0
        cached = tree.insert(key, torch.cat((match.slots, kept)))
        assert cached == match.length, "the tree changed between the match and the insert"
        self.kv.hold(req, tree.match_prefix(key).last_node)
        req.tier_loaded_tokens = kept.numel()
        return req.tier_loaded_tokens

    def _free_slots(self, slots: torch.Tensor) -> None:
        self.kv.allocator.free(slots)
        self.kv.loading_tokens -= slots.numel()

    def cancel(self, req: Req) -> bool:
        """Drop `req` (aborted) and its load; False when it is not held here."""
        if req not in self.loading:
            return False
        ticket = self.loading.pop(req)
        if ticket is not None:
            ticket.cancelled = True  # the read threads stop at their next block; `collect` then frees its slots
            self.abandoned.append(ticket)
        self.kv.release_hold(req)
        return True
