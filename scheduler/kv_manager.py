"""Sequence-level KV bookkeeping over the slot allocator, the radix tree and the
req->token table: admission with prefix reuse, per-step slot allocation,
caching of computed prefixes, fork by reference, release and integrity checks.
"""

from __future__ import annotations

import torch

from stepserve.kvcache import RadixCache, ReqToTokenPool, SlotAllocator, check_slot_ownership
from stepserve.scheduler.sequence import Seq


class KVManager:
    def __init__(
        self,
        allocator: SlotAllocator,
        req_pool: ReqToTokenPool,
        prefix_caching: bool = True,
    ):
        self.allocator = allocator
        self.req_pool = req_pool
        # The tree is used even without cross-request prefix caching: it is what
        # owns a forked request's shared prompt. "No caching" then means that
        # nothing unlocked is kept once a sequence releases it.
        self.tree = RadixCache(allocator)
        self.prefix_caching = prefix_caching

    # -- capacity -------------------------------------------------------------
    def available(self) -> int:
        """Slots obtainable now: free ones plus evictable cached ones."""
        return self.allocator.available() + self.tree.evictable_size()

    @property
    def capacity(self) -> int:
        return self.allocator.num_slots - 1  # slot 0 is padding

    def used(self) -> int:
        return self.capacity - self.available()

    def alloc(self, n: int) -> torch.Tensor | None:
        short = n - self.allocator.available()
        if short > 0:
            self.tree.evict(short)
        return self.allocator.alloc(n)

    # -- admission --------------------------------------------------------------
    def match(self, seq: Seq):
        """Longest cached prefix of everything but the last token (the last one
        must be computed to produce logits)."""
        if not self.prefix_caching or seq.full_prefill:
            return None
        return self.tree.match_prefix(seq.token_ids[: seq.num_tokens - 1])

    def admit(self, seq: Seq, match) -> None:
        row = self.req_pool.alloc()
        assert row is not None, "caller checks req_pool.available()"
        seq.row = row
        m = 0
        if match is not None and match.slots.numel():
            m = int(match.slots.numel())
            self.req_pool.table[row, :m] = match.slots
            self.tree.lock(match.node)
            seq.node = match.node
        seq.num_cached = seq.num_computed = m

    def assign(self, seq: Seq, slots: torch.Tensor) -> None:
        """Records this step's new slots for seq's next `len(slots)` tokens."""
        start = seq.num_computed
        self.req_pool.table[seq.row, start : start + slots.numel()] = slots

    def trim(self, seq: Seq, n: int) -> None:
        """Cuts seq's computed tokens to its first `n` (n is past its cached
        prefix: only private slots are freed)."""
        if seq.num_computed <= n:
            return
        assert n >= seq.num_cached, "trim reaches into the cached prefix"
        self.allocator.free(self.req_pool.table[seq.row, n : seq.num_computed].clone())
        seq.num_computed = n

    # -- caching ---------------------------------------------------------------
    def cache_prefix(self, seq: Seq) -> None:
        """Hands seq's computed tokens to the tree (the tree keeps slots it already
        had, so duplicate private slots are freed) and re-locks the deeper node."""
        n = seq.num_computed
        if n == seq.num_cached:
            return
        row = self.req_pool.table[seq.row]
        tokens = seq.token_ids[:n]
        already = self.tree.insert(tokens, row[:n].clone())
        if already > seq.num_cached:
            self.allocator.free(row[seq.num_cached : already].clone())
        match = self.tree.match_prefix(tokens)
        assert match.slots.numel() == n, "tree must now hold the whole computed prefix"
        row[:n] = match.slots
        self.tree.lock(match.node)
        if seq.node is not None:
            self.tree.unlock(seq.node)
        seq.node = match.node
        seq.num_cached = n

    def fork(self, parent: Seq, child: Seq) -> None:
        """child shares parent's (fully cached) prefix by reference."""
        assert parent.num_cached == parent.num_computed
        row = self.req_pool.alloc()
        assert row is not None, "admission reserved rows for the children"
        n = parent.num_computed
        self.req_pool.table[row, :n] = self.req_pool.table[parent.row, :n]
        child.row = row
        child.node = parent.node
        self.tree.lock(parent.node)
        child.num_cached = child.num_computed = n

    def release(self, seq: Seq, cache: bool = True) -> None:
        """Frees seq's KV: computed tokens go to the tree (when caching), the rest
        back to the allocator; the row and the lock are dropped."""
        if seq.row is None:
            return
        if cache and self.prefix_caching:
            self.cache_prefix(seq)
        row = self.req_pool.table[seq.row]
        if seq.num_computed > seq.num_cached:
            self.allocator.free(row[seq.num_cached : seq.num_computed].clone())
        if seq.node is not None:
            self.tree.unlock(seq.node)
        self.req_pool.free(seq.row)
        seq.row, seq.node = None, None
        seq.num_cached = seq.num_computed = 0
        if not self.prefix_caching:
            self.tree.evict(self.tree.evictable_size())

    # -- integrity ---------------------------------------------------------------
    def check(self, running: list[Seq]) -> None:
        """Every slot is free, cached, or privately owned by exactly one running
        sequence; every running sequence's cached prefix is what the tree holds."""
        self.tree.check()
        owned = {}
        for seq in running:
            if seq.row is None:
                continue
            row = self.req_pool.table[seq.row]
            owned[seq.seq_id] = row[seq.num_cached : seq.num_computed]
            if seq.num_cached:
                assert seq.node is not None, f"seq {seq.seq_id} has a cached prefix but no lock"
        check_slot_ownership(self.allocator, self.tree, owned)
