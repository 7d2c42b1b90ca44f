"""Radix tree over token ids whose values are KV slots (SGLang's RadixAttention).

Every root-to-node path spells a token prefix whose K/V is already computed;
`node.value[i]` is the slot holding the K/V of token `node.key[i]`. Requests
that share a prompt prefix reuse those slots instead of recomputing them.

Ownership: the tree owns the slots of every node. A request owns only the
slots it allocated beyond its matched prefix, until it `insert`s them; and it
must `lock` its matched node so that eviction cannot free the prefix under it.
Eviction frees unlocked leaves, least recently used first.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .allocator import SlotAllocator

_node_ids = itertools.count()


@dataclass(eq=False)  # identity semantics: nodes live in dicts/heaps, never compared by value
class TreeNode:
    key: list[int]  # token ids of this edge; non-empty except at the root
    value: torch.Tensor  # int64 [len(key)]: KV slot of each token in `key`
    parent: TreeNode | None = None
    children: dict[int, TreeNode] = field(default_factory=dict)  # keyed by child.key[0]
    # Number of locks on this node or any descendant. Locks propagate upward so
    # that "lock_ref == 0" alone says a node may be evicted.
    lock_ref: int = 0
    # Locks taken on exactly this node (lock_ref minus the children's share);
    # kept only so that check() can verify lock_ref independently.
    direct_locks: int = 0
    last_access: int = 0  # logical clock of the last match/insert that touched it
    id: int = field(default_factory=lambda: next(_node_ids))  # heap tie-break

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        key = self.key if len(self.key) <= 8 else [*self.key[:8], "..."]
        return f"TreeNode(id={self.id}, key={key}, lock_ref={self.lock_ref}, children={len(self.children)})"


@dataclass
class MatchResult:
    slots: torch.Tensor  # int64 [m]: KV slots of the matched prefix (m may be 0)
    node: TreeNode  # deepest node of the match (root if m == 0); lock it to protect the prefix

    @property
    def length(self) -> int:
        return self.slots.numel()


def _as_list(tokens: Sequence[int] | torch.Tensor) -> list[int]:
    # Keys are plain lists: list == list slice comparisons run in C, and a tuple
    # would never compare equal to a list slice.
    if isinstance(tokens, torch.Tensor):
        return tokens.tolist()
    return tokens if type(tokens) is list else list(tokens)


def _common_len(key: list[int], tokens: list[int], start: int) -> int:
    """Length of the common prefix of `key` and `tokens[start:]`."""
    n = len(key)
    # Fast path: whole edge matches (the common case along a long shared
    # prompt) is one C-level slice comparison.
    if tokens[start : start + n] == key:
        return n
    m = min(n, len(tokens) - start)
    i = 0
    while i < m and key[i] == tokens[start + i]:
        i += 1
    return i


class RadixCache:
    def __init__(self, allocator: SlotAllocator, disable: bool = False):
        self.allocator = allocator
        self.device = allocator.device
        self.disable = disable
        self.reset()

    def reset(self) -> None:
        """Forget everything. Does NOT return slots to the allocator: pair it with
        `allocator.reset()` (flush_cache), done when no request is running."""
        self.root = TreeNode(key=[], value=self._empty())
        self._clock = 0  # logical LRU clock: deterministic, unlike wall time
        self._evictable = 0  # tokens in nodes with lock_ref == 0
        self._protected = 0  # tokens in nodes with lock_ref > 0
        self._num_nodes = 0  # excluding the root
        # Eviction candidates, a min-heap of (last_access, id, node) kept across
        # calls with lazy deletion: an entry is pushed whenever a node becomes an
        # unlocked leaf or is touched while it is one, and an entry whose node
        # has since been locked, grown children, been touched again or been
        # evicted is dropped when it surfaces. Eviction then costs O(log n) per
        # freed node instead of a walk over the whole tree per call, which on a
        # full pool is every step.
        # The third field breaks ties between two entries of one node and stamp
        # (an unlock re-offers a node that is already in), so nodes are never compared.
        self._lru: list[tuple[int, int, int, TreeNode]] = []
        self._pushes = itertools.count()

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _offer(self, node: TreeNode) -> None:
        """Record `node` as an eviction candidate if it is one now."""
        if node.lock_ref == 0 and not node.children and node is not self.root:
            heapq.heappush(self._lru, (node.last_access, node.id, next(self._pushes), node))
            if len(self._lru) > 2 * self._num_nodes + 1024:
                self._lru = [e for e in self._lru if self._current(e)]
                heapq.heapify(self._lru)

    @staticmethod
    def _current(entry: tuple[int, int, int, TreeNode]) -> bool:
        """Whether a heap entry still names an evictable leaf as it was pushed."""
        stamp, _, _, node = entry
        return node.parent is not None and node.lock_ref == 0 and not node.children and node.last_access == stamp

    # ------------------------------------------------------------------ match

    def match_prefix(self, tokens: Sequence[int]) -> MatchResult:
        """Longest cached prefix of `tokens`.

        A match ending inside an edge splits that node so the result ends on a
        node boundary: the returned node can then be locked without also
        protecting the unmatched tail. Refreshes the LRU clock along the path.
        """
        key = _as_list(tokens)
        if self.disable or not key:
            return MatchResult(self._empty(), self.root)
        now = self._tick()
        node = self.root
        node.last_access = now
        values: list[torch.Tensor] = []
        pos = 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            n = _common_len(child.key, key, pos)
            split = n < len(child.key)
            if split:
                # The unmatched tail keeps its old timestamp: it was not used.
                child = self._split(child, n, now)
            child.last_access = now
            values.append(child.value)
            node = child
            pos += n
            if split:  # the match ended inside that edge
                break
        self._offer(node)  # touched: an unlocked leaf moves to the back of the LRU
        # Always a fresh tensor (cat copies even one piece): the caller may write
        # into it, and node values must never change behind the tree's back.
        slots = torch.cat(values) if values else self._empty()
        return MatchResult(slots, node)

    def _split(self, child: TreeNode, n: int, now: int) -> TreeNode:
        """Cut `child`'s edge after `n` tokens (0 < n < len(key)); return the new upper node.

        `child` keeps its identity as the lower part, so any lock a request took
        on it still covers the same (full) prefix. The upper node inherits
        child's lock_ref: every lock below or on child is also below it.
        Sizes are unchanged (same tokens, same lock state).
        """
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key)
        upper = TreeNode(
            key=child.key[:n],
            value=child.value[:n],
            parent=parent,
            lock_ref=child.lock_ref,
            last_access=now,
        )
        upper.children[child.key[n]] = child
        parent.children[child.key[0]] = upper
        child.parent = upper
        child.key = child.key[n:]
        child.value = child.value[n:]
        self._num_nodes += 1
        return upper

    # ----------------------------------------------------------------- insert

    def insert(self, tokens: Sequence[int], slots: torch.Tensor) -> int:
        """Add `tokens` -> `slots`; return how many leading tokens were ALREADY cached.

        With r the returned length, the tree keeps the slots it already had for
        tokens[:r] and takes ownership of slots[r:]. The caller still owns
        slots[:r]; those in [its own matched length, r) are duplicates (another
        request cached the same tokens meanwhile) that the caller must free.
        """
        key = _as_list(tokens)
        if slots.dim() != 1 or slots.numel() != len(key):
            raise ValueError(f"insert: {len(key)} tokens but slots of shape {tuple(slots.shape)}")
        if self.disable or not key:
            return 0
        now = self._tick()
        node = self.root
        node.last_access = now
        pos = 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                # Clone: callers typically pass a slice of the req->token table,
                # whose row is reused once the request leaves.
                leaf = TreeNode(
                    key=key[pos:],
                    value=slots[pos:].to(device=self.device, dtype=torch.int64, copy=True),
                    parent=node,
                    last_access=now,
                )
                node.children[key[pos]] = leaf
                self._evictable += len(leaf.key)  # a new leaf is never locked
                self._num_nodes += 1
                self._offer(leaf)
                return pos
            n = _common_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n, now)
            child.last_access = now
            node = child
            pos += n
        self._offer(node)
        return pos

    # ------------------------------------------------------------ lock/unlock

    def lock(self, node: TreeNode) -> None:
        """Protect the prefix ending at `node` from eviction (no-op for root)."""
        if node is self.root:
            return
        assert node.parent is not None, f"lock: {node!r} is no longer in the tree (evicted?)"
        node.direct_locks += 1
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        if node is self.root:
            return
        if node.direct_locks <= 0:
            raise RuntimeError(f"unlock without matching lock: {node!r}")
        node.direct_locks -= 1
        while node is not self.root:
            assert node.lock_ref > 0 and node.parent is not None
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
                self._offer(node)
            node = node.parent

    # ------------------------------------------------------------------ evict

    def evict(self, num_tokens: int) -> int:
        """Free least-recently-used unlocked leaves until >= num_tokens are freed
        or nothing is evictable. A parent whose last child goes becomes a
        candidate in turn. Returns the number of tokens (slots) freed."""
        if self.disable or num_tokens <= 0 or self._evictable == 0:
            return 0
        freed = 0
        released: list[torch.Tensor] = []
        while freed < num_tokens and self._lru:
            entry = heapq.heappop(self._lru)
            if not self._current(entry):
                continue  # stale: locked, grown, touched again or gone since
            node = entry[3]
            parent = node.parent
            assert parent is not None
            del parent.children[node.key[0]]
            node.parent = None
            released.append(node.value)
            freed += len(node.key)
            self._evictable -= len(node.key)
            self._num_nodes -= 1
            self._offer(parent)  # a parent whose last child left is a candidate in turn
        if released:
            self.allocator.free(torch.cat(released))
        return freed

    # ------------------------------------------------------------------ sizes

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    # -------------------------------------------------------------- integrity

    def _nodes(self) -> list[TreeNode]:
        """All non-root nodes (iterative DFS: deep trees must not hit the recursion limit)."""
        out: list[TreeNode] = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def check(self) -> torch.Tensor:
        """Assert every internal invariant; return all slots the tree holds."""
        root = self.root
        assert root.parent is None and root.key == [] and root.value.numel() == 0, "bad root"
        assert root.lock_ref == 0 and root.direct_locks == 0, "root must never be locked"
        evictable = protected = count = 0
        candidates = {id(e[3]) for e in self._lru if self._current(e)}
        values: list[torch.Tensor] = []
        seen: set[int] = {id(root)}
        stack = [root]
        while stack:
            node = stack.pop()
            child_locks = 0
            for tok, child in node.children.items():
                assert id(child) not in seen, f"node reachable twice (cycle/shared child): {child!r}"
                seen.add(id(child))
                assert child.parent is node, f"parent pointer broken at {child!r}"
                assert len(child.key) > 0, f"empty key on non-root node {child!r}"
                assert child.key[0] == tok, f"child keyed by {tok} but key starts with {child.key[0]}"
                assert isinstance(child.key, list), f"key is {type(child.key).__name__}, not list"
                assert child.value.dtype == torch.int64 and child.value.dim() == 1, (
                    f"value must be int64 1-D, got {child.value.dtype} {tuple(child.value.shape)}"
                )
                assert child.value.numel() == len(child.key), (
                    f"key/value length mismatch {len(child.key)} != {child.value.numel()} at {child!r}"
                )
                child_locks += child.lock_ref
                stack.append(child)
            if node is not root:
                count += 1
                assert node.direct_locks >= 0, f"negative direct_locks at {node!r}"
                assert node.lock_ref == node.direct_locks + child_locks, (
                    f"lock_ref {node.lock_ref} != own locks {node.direct_locks} + children's {child_locks} at {node!r}"
                )
                if node.lock_ref > 0:
                    protected += len(node.key)
                else:
                    evictable += len(node.key)
                    if not node.children:
                        assert id(node) in candidates, f"unlocked leaf missing from the eviction heap: {node!r}"
                values.append(node.value)
        assert evictable == self._evictable, f"evictable_size {self._evictable} != recomputed {evictable}"
        assert protected == self._protected, f"protected_size {self._protected} != recomputed {protected}"
        assert count == self._num_nodes, f"node count {self._num_nodes} != recomputed {count}"
        slots = torch.cat(values) if values else self._empty()
        if slots.numel():
            s = slots.cpu()
            assert int(s.min()) >= 1, "padding slot 0 (or a negative slot) is in the tree"
            assert int(s.max()) < self.allocator.num_slots, f"slot {int(s.max())} out of range"
            uniq = torch.unique(s)
            if uniq.numel() != s.numel():
                counts = torch.bincount(s)
                dup = torch.nonzero(counts > 1).flatten().tolist()
                raise AssertionError(f"slots held twice by the tree: {dup[:20]}")
        return slots

    def pretty(self) -> str:
        """Debug dump, one node per line."""
        lines: list[str] = []

        def walk(node: TreeNode, depth: int) -> None:
            for tok in sorted(node.children):
                ch = node.children[tok]
                lines.append(
                    f"{'  ' * depth}{ch.key} -> {ch.value.tolist()} lock={ch.lock_ref} t={ch.last_access}"
                )
                walk(ch, depth + 1)

        walk(self.root, 0)
        return "\n".join(lines)
