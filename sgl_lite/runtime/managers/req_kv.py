"""Who owns which KV slot: the bookkeeping between requests, the slot allocator and the radix tree.

A request holding a req_to_token row owns `kv_len - prefix_len` private slots (row[prefix_len:kv_len]);
its first `prefix_len` slots belong to the tree and are locked through `req.last_node`. Every other
slot is free, in the tree, or being loaded into from the disk tier. So at any time:

    free + evictable + protected + sum(private of row holders) + loading == num_slots

(`loading`: the slots the disk tier's loads read into, before their tokens join the tree.)

`accounting_error` checks exactly that; the scheduler asserts it after steps and in tests.

With the disk tier (`--enable-hierarchical-cache`, mem_cache/hicache/) the KV also goes to disk: with
write_through when a request leaves with KV the tree keeps (a finished turn, which the conversation's next
turn extends; prefill-only hints are not written) and, for a prompt prefilled in chunks, its whole blocks after
each chunk; with write_back when the tree evicts it. Either way a block
already stored is not written again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from sgl_lite.runtime.managers.in_batch_sharing import Borrow
from sgl_lite.runtime.managers.request import Req
from sgl_lite.runtime.mem_cache.hicache.tier import KVTier
from sgl_lite.runtime.mem_cache.memory_pool import ReqToTokenPool, SlotAllocator
from sgl_lite.runtime.mem_cache.radix_cache import MatchResult, RadixCache, TreeNode
from sgl_lite.runtime.model_executor.forward_batch import ForwardBatch


class ReqKV:
    def __init__(self, num_slots: int, req_to_token: ReqToTokenPool, disable_cache: bool, tier: KVTier | None = None) -> None:
        self.num_slots = num_slots
        self.req_to_token = req_to_token
        self.allocator = SlotAllocator(num_slots, req_to_token.table.device)
        self.tree_cache = RadixCache(self.allocator, req_to_token, disable=disable_cache)
        self.tier = tier
        self.held_tokens = 0  # tokens on paths the disk tier's holds lock (overlapping paths counted each time)
        self.loading_tokens = 0  # slots the disk tier's loads are reading into (tier_loads.py): in no tree nor row
        if tier is not None and tier.write_policy == "write_back":
            self.tree_cache.before_evict = self._spill

    def start(self, req: Req, match: MatchResult) -> None:
        """Give an admitted request a row holding its cached prefix (already locked by admission)."""
        row = self.req_to_token.alloc()
        if row is None:
            raise RuntimeError("admission exceeded the request rows (scheduler bug)")
        req.req_pool_idx = row
        req.last_node = match.last_node
        req.prefix_len = req.kv_len = match.length
        self.req_to_token.table[row, : match.length] = match.slots
        self.release_hold(req)  # admission's own lock on the prefix replaces the disk tier's hold

    def hold(self, req: Req, node: TreeNode) -> None:
        """Lock the path to `node` for `req` while the disk tier loads its prefix or it waits for admission
        (managers/tier_loads.py); a hold it had before is released after the new one is taken."""
        self.tree_cache.inc_lock_ref(node)
        self.release_hold(req)
        req.tier_hold = node
        self.held_tokens += node.depth

    def release_hold(self, req: Req) -> None:
        """Unlock the prefix the disk tier held for `req`, if any."""
        if req.tier_hold is not None:
            self.tree_cache.dec_lock_ref(req.tier_hold)
            self.held_tokens -= req.tier_hold.depth
            req.tier_hold = None

    def release(self, req: Req) -> None:
        """Give the request's computed KV to the radix tree (or free it) and return its row; a finished request
        of a session pins its KV as the session's latest prefix (mem_cache/session_pins.py)."""
        self.release_hold(req)
        if req.req_pool_idx is None:
            return
        if self._writes_through(req):
            self._write_through(req, req.kv_len)
        self.tree_cache.cache_finished_req(req)
        if req.session_pin is not None and req.finished and req.kv_len and not self.tree_cache.disable:
            # The tree holds all kv_len tokens now: the match ends exactly at their last node.
            node = self.tree_cache.match_prefix(req.fill_ids[: req.kv_len]).last_node
            self.tree_cache.pins.pin(req.session_pin.id, node, req.session_pin.idle_timeout_s)
        self.req_to_token.free(req.req_pool_idx)
        req.req_pool_idx, req.kv_len, req.prefix_len, req.last_node = None, 0, 0, None

    def write_chunk(self, req: Req) -> None:
        """write_through, a prompt prefilled in chunks: the whole blocks computed so far go to disk after each
        chunk, so its writes keep pace with its prefill instead of waiting, all of them at once, for the request to
        leave (the tier drops what passes its backlog's bound; a long prompt's KV alone can pass it)."""
        if self._writes_through(req):
            self._write_through(req, req.kv_len // self.tier.block_tokens * self.tier.block_tokens)  # type: ignore[union-attr]

    def _writes_through(self, req: Req) -> bool:
        return self.tier is not None and self.tier.write_policy == "write_through" and req.wants_sampling \
            and not self.tree_cache.disable

    def _write_through(self, req: Req, length: int) -> None:
        if length:
            row = self.req_to_token.table[req.req_pool_idx]
            self.tier.write(req.fill_ids[:length], row[:length])  # type: ignore[union-attr]

    def unpin_session(self, key: str) -> bool:
        """The session `key` ended: its prefix is evicted like any other from now on (False: it had no pin)."""
        return self.tree_cache.pins.release(key)

    def ensure_free(self, num_tokens: int) -> bool:
        """Evict until `num_tokens` slots are free; False (evicting nothing) when free + evictable is short."""
        short = num_tokens - self.allocator.available_size
        if short > 0:
            if short > self.tree_cache.evictable_size():
                return False
            self.tree_cache.evict(short)
        return self.allocator.available_size >= num_tokens

    def build_batch(self, parts: list[tuple[Req, int]], is_decode: bool,
                    borrows: Sequence[Borrow | None] = (), drafts: Sequence[list[int]] | None = None) -> ForwardBatch:
        """Allocate slots for `n` new tokens of each (req, n) and write them into the rows.

        With `drafts` (speculative decoding, one list per part), part i's last len(drafts[i]) new
        tokens are its draft, computed after its own tokens.

        With `borrows` (in-batch prefix sharing, one entry per part), part i's first
        `borrows[i].length` tokens take the slots its lenders hold at those positions instead of new
        ones: its prefix grows and its extend shrinks by that much. Lenders come earlier in `parts`,
        so their rows are written first.
        """
        borrowed = [b.length if b is not None else 0 for b in borrows] or [0] * len(parts)
        total = sum(n - b for (_, n), b in zip(parts, borrowed))
        slots = self.allocator.alloc(total) if self.ensure_free(total) else None
        if slots is None:
            raise RuntimeError(f"KV allocation of {total} slots failed after admission (budget bug)")
        table, offset = self.req_to_token.table, 0
        rows = [req.req_pool_idx for req, _ in parts]
        assert None not in rows, "every part holds a req_to_token row"
        if not any(borrowed) and all(n == 1 for _, n in parts):
            # A decode step (one new slot per row): one indexing op for all rows, not a slice assignment
            # each (each one costs the scheduler's loop, which shares the cores with the forward's threads).
            table[torch.tensor(rows, device=table.device), torch.tensor([req.kv_len for req, _ in parts], device=table.device)] = slots
        else:
            for i, (req, n) in enumerate(parts):
                start, b = req.kv_len, borrowed[i]
                if b:
                    lender_rows = torch.tensor(rows, device=table.device)[borrows[i].lenders.to(table.device)]  # type: ignore[union-attr]
                    positions = torch.arange(start, start + b, device=table.device)
                    table[req.req_pool_idx, start : start + b] = table[lender_rows, positions]
                table[req.req_pool_idx, start + b : start + n] = slots[offset : offset + n - b]
                offset += n - b
        return ForwardBatch(
            reqs=[r for r, _ in parts],
            prefix_lens=[r.kv_len + b for (r, _), b in zip(parts, borrowed)],
            extend_lens=[n - b for (_, n), b in zip(parts, borrowed)],
            out_cache_loc=slots,
            sample=[r.kv_len + n - len(d) == r.seq_len and r.wants_sampling
                    for (r, n), d in zip(parts, drafts or [[]] * len(parts))],
            is_decode=is_decode,
            draft_ids=list(drafts) if drafts is not None else None,
        )

    def _spill(self, leaf: TreeNode) -> None:
        """write_back: the blocks ending in `leaf` (the partial one at its end too), the path above it still in
        the pool, go to disk."""
        keys, values, node = [], [], leaf
        while node is not None and node is not self.tree_cache.root_node:
            keys.append(node.key)
            values.append(node.value)
            node = node.parent
        tokens = [t for key in reversed(keys) for t in key]
        assert self.tier is not None
        self.tier.write(tokens, torch.cat(values[::-1]), from_pos=leaf.depth - len(leaf.key))

    def spill_all(self) -> None:
        """Queue every block the tree holds and the tier does not, a partial one at each node's end (shutdown)."""
        if self.tier is not None:
            for node in list(self.tree_cache.iter_nodes()):
                if node is not self.tree_cache.root_node:
                    self._spill(node)

    def flush(self) -> None:
        """Drop the tree and every slot and row (only when no request holds any)."""
        self.tree_cache.reset()
        self.allocator.clear()
        self.req_to_token.clear()

    def accounting_error(self, live: Iterable[Req]) -> str | None:
        """None when every slot and row is accounted for; else what is off."""
        live = list(live)
        holders = [r for r in live if r.req_pool_idx is not None]
        held = sum(r.tier_hold.depth for r in live if r.tier_hold is not None)
        if held != self.held_tokens:
            return f"disk tier holds: live requests hold {held} tokens, the count says {self.held_tokens}"
        private = sum(r.kv_len - r.prefix_len for r in holders)
        free, evictable, protected = self.allocator.available_size, self.tree_cache.evictable_size(), self.tree_cache.protected_size()
        loading = self.loading_tokens
        if free + evictable + protected + private + loading != self.num_slots:
            return (f"slot accounting: free {free} + evictable {evictable} + protected {protected} + private {private} "
                    f"+ loading {loading} != total {self.num_slots}")
        if len(holders) + self.req_to_token.available_size != self.req_to_token.max_requests:
            return f"req_to_token rows: {len(holders)} held + {self.req_to_token.available_size} free != {self.req_to_token.max_requests}"
        return None
