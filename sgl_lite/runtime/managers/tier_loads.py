"""Requests whose cacheable prefix continues on the disk tier wait here, outside the queue, while it loads.

A request arriving with more of its prefix on disk than the tree holds (`KVTier.loadable`: whole blocks, then a
partial last block it has every token of) is held: its matched prefix is locked (`req.tier_hold`, so the part the
load continues cannot be evicted meanwhile) and the tier reads the blocks on its thread. Each step `collect` installs the finished loads: fresh slots (evicting
as any allocation does), the blocks' KV copied in, the tokens inserted into the tree, the hold moved onto the new
node; the request then joins the queue and matches the whole prefix like any other. Admission drops the hold
once its own lock is taken (`ReqKV.start`); an abort drops it here. Loads that cannot start (staging full) wait
their turn in arrival order; a load that fails, or cannot find room while nothing else runs, is dropped and the
request computes its prefix as it would without the tier (a load with no room lets go of its hold too, since
other loads' holds may be what fills the pool). Installed prefixes waiting for admission hold at most half the
pool between them, so admission always has room; holds of requests still loading are not counted there, as no
admission releases them.

Holds are tree locks: the slot accounting (req_kv.py) counts them as protected tokens, and an idle scheduler
holds none.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from sgl_lite.runtime.managers.policy import prefix_match_key
from sgl_lite.runtime.managers.req_kv import ReqKV
from sgl_lite.runtime.managers.request import Req
from sgl_lite.runtime.mem_cache.hicache.kv_transfer import scatter_blocks
from sgl_lite.runtime.mem_cache.hicache.tier import KVTier, LoadTicket

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

    def any_ready(self) -> bool:
        """Whether `collect` would return or start anything now (a server loop waits otherwise)."""
        return any(ticket is None or ticket.done.is_set() for ticket in self.loading.values())

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
        self.loading[req] = self.tier.start_load(key, run) if self.tier.can_stage(run) else None
        return True

    def collect(self) -> list[Req]:
        """The held requests whose loads ended (installed or dropped), in arrival order; starts waiting loads."""
        for ticket in [t for t in self.abandoned if t.done.is_set()]:
            self.abandoned.remove(ticket)
            self.tier.finish_load(ticket, 0)
        ready = []
        for req, ticket in list(self.loading.items()):
            if ticket is None:
                key = prefix_match_key(req)
                run = self.tier.loadable(key, req.tier_hold.depth)
                if not run.keys:
                    del self.loading[req]
                    ready.append(req)
                elif self.tier.can_stage(run):
                    self.loading[req] = self.tier.start_load(key, run)
                continue
            if not ticket.done.is_set():
                continue
            installed = self._install(req, ticket)
            if installed is None:  # no room yet, and running requests will make some
                continue
            self.tier.finish_load(ticket, installed)
            del self.loading[req]
            ready.append(req)
        return ready

    def _install(self, req: Req, ticket: LoadTicket) -> int | None:
        """Put the loaded blocks into the pool and the tree; the tokens installed (0: dropped), None: later."""
        tree = self.kv.tree_cache
        end = ticket.loaded_end
        key = prefix_match_key(req)[:end]
        match = tree.match_prefix(key)  # at least the held prefix; more if another request computed it meanwhile
        count = end - match.length
        if count <= 0:
            return 0
        # Loaded prefixes wait for admission locked; the queued requests' may take half the pool, so admission
        # always has room (admitting them releases theirs). Holds of requests still loading do not count: no
        # admission releases them, so two loads waiting on each other's holds would wait for ever.
        queued_held = self.kv.held_tokens - sum(r.tier_hold.depth for r in self.loading if r.tier_hold is not None)
        if queued_held and queued_held + count > self.kv.num_slots // 2:
            return None
        tree.inc_lock_ref(match.last_node)  # the part matched beyond the hold must survive the eviction below
        try:
            if not self.kv.ensure_free(count):
                if self.others_running():
                    return None
                # Nothing running will make room: loading holds may lock what is left, so this one lets go too.
                logger.info("hierarchical cache: no room for %d loaded tokens of %s; they are recomputed", count, req.rid)
                self.kv.release_hold(req)
                return 0
            slots = self.kv.allocator.alloc(count)
            assert slots is not None, "ensure_free promised the room"
            started = time.perf_counter()
            scatter_blocks(self.tier.pool, ticket.blocks, match.length - ticket.start, slots)
            ticket.copy_seconds = time.perf_counter() - started
            cached = tree.insert(key, torch.cat((match.slots, slots)))
            assert cached == match.length, "the tree changed between the match and the insert"
            self.kv.hold(req, tree.match_prefix(key).last_node)
        finally:
            tree.dec_lock_ref(match.last_node)
        req.tier_loaded_tokens = count
        return count

    def cancel(self, req: Req) -> bool:
        """Drop `req` (aborted) and its load; False when it is not held here."""
        if req not in self.loading:
            return False
        ticket = self.loading.pop(req)
        if ticket is not None:
            ticket.cancelled = True  # the read thread stops at its next block; `collect` releases its staging
            self.abandoned.append(ticket)
        self.kv.release_hold(req)
        return True
