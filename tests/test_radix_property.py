"""Stateful property test: RadixCache + SlotAllocator against a naive reference model.

The reference is a dict from every cached token prefix (a tuple) to the KV slot
of its last token, plus a logical access time per prefix. Requests are driven
the way the scheduler drives them (match + lock, allocate the rest, decode,
cache_unfinished, finish / abort), interleaved so that two requests often
compute the same tokens and `insert` has to report duplicates. A tiny
alphabet makes prefixes collide, and a small pool forces eviction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from stepserve.kvcache import RadixCache, SlotAllocator, TreeNode, check_slot_ownership

NUM_SLOTS = 25  # 24 usable: small enough that eviction and alloc failure happen
TOKENS = st.lists(st.integers(0, 1), min_size=1, max_size=6)
PICK = st.integers(0, 1_000)  # index into a list, taken modulo its length


@dataclass
class Req:
    tokens: list[int]
    slots: torch.Tensor  # KV slot of every token
    tree_len: int  # tokens[:tree_len] are tree-owned (and locked via `node`); the rest are private
    node: TreeNode


class RadixMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.alloc = SlotAllocator(NUM_SLOTS)
        self.tree = RadixCache(self.alloc)
        self.ref: dict[tuple[int, ...], int] = {}  # cached prefix -> slot of its last token
        self.atime: dict[tuple[int, ...], int] = {}  # cached prefix -> last access (model clock)
        self.clock = 0
        self.reqs: dict[int, Req] = {}
        self.next_rid = 0
        self.ext_locks: list[tuple[TreeNode, tuple[int, ...]]] = []  # locks not tied to a request
        self.admitting: tuple[int, ...] = ()  # prefix locked by a request still being admitted

    # ------------------------------------------------------------ reference

    def ref_match(self, tokens: list[int]) -> list[int]:
        slots = []
        for i in range(len(tokens)):
            s = self.ref.get(tuple(tokens[: i + 1]))
            if s is None:
                break
            slots.append(s)
        return slots

    def locked_prefixes(self) -> set[tuple[int, ...]]:
        held = [p for _, p in self.ext_locks] + [self.admitting]
        held += [tuple(r.tokens[: r.tree_len]) for r in self.reqs.values()]
        return {p[:i] for p in held for i in range(1, len(p) + 1)}

    def touch(self, tokens: list[int], n: int) -> None:
        self.clock += 1
        for i in range(1, n + 1):
            self.atime[tuple(tokens[:i])] = self.clock

    # ------------------------------------------------- checked tree wrappers

    def match(self, tokens: list[int]):
        m = self.tree.match_prefix(tokens)
        expected = self.ref_match(tokens)
        assert m.slots.tolist() == expected, (tokens, m.slots.tolist(), expected)
        # The node ends exactly at the matched prefix (split if needed).
        path: list[int] = []
        node = m.node
        while node.parent is not None:
            path = node.key + path
            node = node.parent
        assert node is self.tree.root and path == tokens[: len(expected)]
        self.touch(tokens, len(expected))
        return m

    def insert(self, req: Req) -> int:
        """Insert the request's tokens; free its duplicates; return r."""
        tokens, slots = req.tokens, req.slots
        already = len(self.ref_match(tokens))
        r = self.tree.insert(tokens, slots)
        assert r == already, (tokens, r, already)
        assert r >= req.tree_len  # its own locked prefix cannot have gone
        for i in range(r, len(tokens)):
            self.ref[tuple(tokens[: i + 1])] = int(slots[i])
        self.touch(tokens, len(tokens))
        # SGLang contract: the tree kept its slots for [0, r); ours in
        # [tree_len, r) are duplicates we still own and must free.
        self.alloc.free(slots[req.tree_len : r])
        if r > req.tree_len:
            event("insert found duplicates")
        return r

    def alloc_or_evict(self, n: int) -> torch.Tensor | None:
        got = self.alloc.alloc(n)
        if got is None:
            assert self.alloc.available() < n
            self.evict_checked(n - self.alloc.available())
            got = self.alloc.alloc(n)
            event("alloc needed eviction" if got is not None else "alloc failed")
        if got is not None:
            assert got.numel() == n and got.dtype == torch.int64
        return got

    def evict_checked(self, n: int) -> int:
        before = set(self.tree.check().tolist())
        avail, evictable = self.alloc.available(), self.tree.evictable_size()
        locked = self.locked_prefixes()
        freed = self.tree.evict(n)
        after = set(self.tree.check().tolist())
        gone_slots = before - after
        assert after <= before
        assert freed == len(gone_slots) <= evictable
        assert self.alloc.available() == avail + freed  # every freed slot reached the allocator
        assert gone_slots <= set(self.alloc.free_slots().tolist())
        if n > 0:
            assert freed >= min(n, evictable)
        if freed < n:
            assert self.tree.evictable_size() == 0
        if freed:
            event("evicted something")
        gone = {p for p, s in self.ref.items() if s in gone_slots}
        assert len(gone) == freed
        assert not (gone & locked), f"evicted locked prefixes {gone & locked}"
        for p in gone:
            del self.ref[p]
        # Only leaves' suffixes disappear: what remains is still prefix-closed
        # (no surviving prefix extends a gone one).
        for p in self.ref:
            assert p[:-1] == () or p[:-1] in self.ref, f"{p} survived without its parent"
        # LRU: nothing evicted was used more recently than any surviving
        # unlocked leaf (pops come out in non-decreasing access time).
        if gone:
            newest_gone = max(self.atime[p] for p in gone)
            has_child = {p[:-1] for p in self.ref}
            for p in self.ref:
                if p not in has_child and p not in locked:
                    assert self.atime[p] >= newest_gone, (p, self.atime[p], newest_gone)
        for p in gone:
            del self.atime[p]
        return freed

    # ----------------------------------------------------------------- rules

    @initialize(prompts=st.lists(TOKENS, max_size=4))
    def warm(self, prompts):
        """Start from a populated cache so that early steps already hit,
        collide and evict, instead of spending the run filling an empty tree."""
        for tokens in prompts:
            self.admit(tokens)
        for rid in list(self.reqs):
            self.finish_request(0)

    @rule(tokens=TOKENS)
    def start_request(self, tokens):
        """Admit a request: match + lock its prefix, allocate the rest."""
        self.admit(tokens)

    def admit(self, tokens: list[int]) -> None:
        m = self.match(tokens)
        self.tree.lock(m.node)
        self.admitting = tuple(tokens[: m.slots.numel()])
        new = self.alloc_or_evict(len(tokens) - m.slots.numel())
        self.admitting = ()
        if new is None:
            self.tree.unlock(m.node)
            return
        req = Req(tokens, torch.cat([m.slots, new]), m.slots.numel(), m.node)
        self.reqs[self.next_rid] = req
        self.next_rid += 1

    @rule(pick=PICK, cut=st.integers(0, 8), more=st.lists(st.integers(0, 1), max_size=3))
    def start_same_prompt(self, pick, cut, more):
        """Admit a request sharing a running request's (uncached) tokens: when both
        get inserted, the second one's insert must report the duplicates."""
        if not self.reqs:
            return
        other = self.reqs[sorted(self.reqs)[pick % len(self.reqs)]]
        tokens = other.tokens[: max(1, len(other.tokens) - cut)] + more
        self.admit(tokens)

    @rule(pick=PICK, more=TOKENS)
    def decode(self, pick, more):
        if not self.reqs:  # no-op rather than a precondition: keeps every example valid
            return
        req = self.reqs[sorted(self.reqs)[pick % len(self.reqs)]]
        new = self.alloc_or_evict(len(more))
        if new is None:
            return
        req.tokens = req.tokens + more
        req.slots = torch.cat([req.slots, new])

    @rule(pick=PICK)
    def cache_unfinished(self, pick):
        """Insert a running request's tokens and move its lock to the new node."""
        if not self.reqs:  # no-op rather than a precondition: keeps every example valid
            return
        req = self.reqs[sorted(self.reqs)[pick % len(self.reqs)]]
        self.insert(req)
        m = self.match(req.tokens)
        assert m.slots.numel() == len(req.tokens)
        self.tree.lock(m.node)
        self.tree.unlock(req.node)
        req.slots, req.tree_len, req.node = m.slots, len(req.tokens), m.node

    @rule(pick=PICK)
    def finish_request(self, pick):
        if not self.reqs:  # no-op rather than a precondition: keeps every example valid
            return
        rid = sorted(self.reqs)[pick % len(self.reqs)]
        req = self.reqs.pop(rid)
        self.insert(req)
        self.tree.unlock(req.node)

    @rule(pick=PICK)
    def abort_request(self, pick):
        if not self.reqs:  # no-op rather than a precondition: keeps every example valid
            return
        rid = sorted(self.reqs)[pick % len(self.reqs)]
        req = self.reqs.pop(rid)
        self.alloc.free(req.slots[req.tree_len :])
        self.tree.unlock(req.node)

    @rule(tokens=TOKENS)
    def query(self, tokens):
        self.match(tokens)

    @rule(tokens=TOKENS)
    def lock_prefix(self, tokens):
        if len(self.ext_locks) >= 3:  # unbounded pinning would starve the pool
            return
        m = self.match(tokens)
        self.tree.lock(m.node)
        self.ext_locks.append((m.node, tuple(tokens[: m.slots.numel()])))

    @rule(pick=PICK)
    def unlock_prefix(self, pick):
        if not self.ext_locks:
            return
        node, _ = self.ext_locks.pop(pick % len(self.ext_locks))
        self.tree.unlock(node)

    @rule(n=st.integers(0, 4))  # small: partial evictions exercise LRU order
    def evict(self, n):
        self.evict_checked(n)

    # ------------------------------------------------------------ invariants

    @invariant()
    def consistent(self):
        owned = {rid: r.slots[r.tree_len :] for rid, r in self.reqs.items()}
        check_slot_ownership(self.alloc, self.tree, owned)  # runs tree.check() too
        # Tree content equals the reference exactly.
        got: dict[tuple[int, ...], int] = {}
        stack = [((), self.tree.root)]
        while stack:
            prefix, node = stack.pop()
            for child in node.children.values():
                p = prefix
                for tok, slot in zip(child.key, child.value.tolist()):
                    p = p + (tok,)
                    got[p] = slot
                stack.append((p, child))
        assert got == self.ref
        locked = self.locked_prefixes()
        assert self.tree.protected_size() == len(locked)
        assert self.tree.evictable_size() == len(self.ref) - len(locked)
        assert self.tree.total_size() == len(self.ref)
        for rid, r in self.reqs.items():  # a request's prefix slots are still the tree's
            assert r.slots[: r.tree_len].tolist() == self.ref_match(r.tokens)[: r.tree_len]


TestRadixMachine = RadixMachine.TestCase
TestRadixMachine.settings = settings(
    max_examples=100,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
