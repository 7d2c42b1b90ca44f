"""Unit tests for RadixCache: match/insert/split, locking, LRU eviction."""

from __future__ import annotations

import pytest
import torch

from stepserve.kvcache import RadixCache, SlotAllocator, check_slot_ownership


def make(num_slots: int = 64, disable: bool = False):
    a = SlotAllocator(num_slots)
    return a, RadixCache(a, disable=disable)


def put(a: SlotAllocator, tree: RadixCache, tokens: list[int]) -> torch.Tensor:
    """Cache `tokens` the way a finished request does: reuse the matched prefix,
    allocate the rest, insert, free duplicates."""
    m = tree.match_prefix(tokens)
    new = a.alloc(len(tokens) - m.length)
    slots = torch.cat([m.slots, new])
    r = tree.insert(tokens, slots)
    a.free(slots[m.length : r])
    return slots


def num_nodes(tree: RadixCache) -> int:
    return len(tree._nodes())


def path_tokens(node) -> list[int]:
    out: list[int] = []
    while node.parent is not None:
        out = node.key + out
        node = node.parent
    return out


def test_empty_tree():
    a, t = make()
    m = t.match_prefix([1, 2, 3])
    assert m.slots.numel() == 0 and m.slots.dtype == torch.int64 and m.node is t.root
    assert t.match_prefix([]).node is t.root
    assert t.total_size() == 0 and t.check().numel() == 0
    assert t.evict(10) == 0


def test_insert_then_match_and_split():
    a, t = make()
    s = a.alloc(5)
    assert t.insert([1, 2, 3, 4, 5], s) == 0
    m = t.match_prefix([1, 2, 3, 4, 5, 6])
    assert m.slots.tolist() == s.tolist() and path_tokens(m.node) == [1, 2, 3, 4, 5]
    # Ends inside the edge: the node is split so the result ends on a boundary.
    assert num_nodes(t) == 1
    m = t.match_prefix([1, 2, 3, 9])
    assert m.slots.tolist() == s[:3].tolist()
    assert m.node.key == [1, 2, 3] and path_tokens(m.node) == [1, 2, 3]
    assert list(m.node.children) == [4] and m.node.children[4].key == [4, 5]
    assert num_nodes(t) == 2 and t.total_size() == 5
    # A whole-prefix match still returns all slots across the split.
    assert t.match_prefix([1, 2, 3, 4, 5]).slots.tolist() == s.tolist()
    assert t.match_prefix([2, 1]).length == 0
    t.check()


def test_match_accepts_tuple_and_tensor_tokens():
    a, t = make()
    s = put(a, t, [7, 8, 9])
    assert t.match_prefix((7, 8)).slots.tolist() == s[:2].tolist()
    assert t.match_prefix(torch.tensor([7, 8, 9, 1])).slots.tolist() == s.tolist()
    assert t.insert((7, 8, 9), s.clone()) == 3


def test_match_returns_a_copy():
    a, t = make()
    s = put(a, t, [1, 2, 3])
    m = t.match_prefix([1, 2, 3])
    m.slots.fill_(0)
    assert t.match_prefix([1, 2, 3]).slots.tolist() == s.tolist()


def test_insert_clones_caller_slots():
    a, t = make()
    table = torch.zeros(10, dtype=torch.int64)
    table[:3] = a.alloc(3)
    expected = table[:3].tolist()
    t.insert([1, 2, 3], table[:3])
    table.zero_()  # row reused by the next request
    assert t.match_prefix([1, 2, 3]).slots.tolist() == expected


def test_insert_returns_already_cached_prefix_length():
    a, t = make()
    s1 = a.alloc(4)
    assert t.insert([1, 2, 3, 4], s1) == 0
    # Two requests matched nothing, then both computed [1, 2, 3, 5, 6].
    s2 = a.alloc(5)
    r = t.insert([1, 2, 3, 5, 6], s2)
    assert r == 3
    a.free(s2[:3])  # duplicates: caller frees [its matched len 0, r)
    m = t.match_prefix([1, 2, 3, 5, 6])
    assert m.slots.tolist() == s1[:3].tolist() + s2[3:].tolist()  # tree kept its own slots
    assert t.insert([1, 2, 3, 4], a.alloc(4)) == 4  # fully present
    assert t.insert([1, 2], torch.tensor([50, 51])) == 2  # ends inside an edge: split, nothing new
    assert t.total_size() == 6
    t.check()


def test_insert_length_mismatch_raises():
    a, t = make()
    with pytest.raises(ValueError):
        t.insert([1, 2, 3], a.alloc(2))


def test_lock_protects_from_evict():
    a, t = make()
    put(a, t, [1, 2, 3, 4])
    put(a, t, [1, 2, 5])
    m = t.match_prefix([1, 2, 3, 4])
    t.lock(m.node)
    assert t.protected_size() == 4 and t.evictable_size() == 1
    assert t.evict(100) == 1  # only [5] could go
    assert t.match_prefix([1, 2, 5]).length == 2
    assert t.total_size() == 4
    t.unlock(m.node)
    assert t.protected_size() == 0 and t.evictable_size() == 4
    assert t.evict(100) == 4 and t.total_size() == 0
    assert a.available() == 63
    check_slot_ownership(a, t, {})


def test_lock_is_refcounted_and_survives_split():
    a, t = make()
    put(a, t, [1, 2, 3, 4])
    n = t.match_prefix([1, 2, 3, 4]).node
    t.lock(n)
    t.lock(n)
    # A later match splits the locked edge: the lock still covers the full prefix.
    upper = t.match_prefix([1, 2]).node
    assert upper.lock_ref == 2 and n.lock_ref == 2 and n.parent is upper
    t.check()
    t.unlock(n)
    assert t.evict(10) == 0
    t.unlock(n)
    assert upper.lock_ref == 0
    with pytest.raises(RuntimeError):
        t.unlock(n)
    t.lock(t.root)  # no-op
    t.unlock(t.root)
    t.check()


def test_lru_least_recently_matched_leaf_goes_first():
    a, t = make()
    put(a, t, [1, 1])
    put(a, t, [2, 2])
    put(a, t, [3, 3])
    t.match_prefix([1, 1])  # 1 is now the most recent; 2 the least
    assert t.evict(1) == 2
    assert t.match_prefix([2, 2]).length == 0
    assert t.match_prefix([3, 3]).length == 2  # now [3,3] is older than [1,1]
    assert t.match_prefix([1, 1]).length == 2
    assert t.evict(1) == 2
    assert t.match_prefix([3, 3]).length == 0 and t.match_prefix([1, 1]).length == 2
    t.check()


def test_partial_match_refreshes_only_matched_part():
    a, t = make()
    put(a, t, [1, 2, 3, 4])
    put(a, t, [5, 6])
    t.match_prefix([1, 2, 9])  # split: [1,2] refreshed, tail [3,4] keeps its old time
    assert t.evict(1) == 2  # tail [3,4] is older than [5,6]
    assert t.match_prefix([1, 2, 3]).length == 2
    assert t.match_prefix([5, 6]).length == 2


def test_evict_parent_after_children():
    a, t = make()
    put(a, t, [1, 2, 3])
    put(a, t, [1, 2, 4])
    put(a, t, [9])
    t.match_prefix([9])  # make [9] the most recent
    assert num_nodes(t) == 4  # [1,2] -> {[3], [4]}, [9]
    # Need 3: the two leaves go (1 + 1), then [1,2] became a leaf and is older than [9].
    assert t.evict(3) == 4
    assert t.match_prefix([1]).length == 0 and t.match_prefix([9]).length == 1
    assert num_nodes(t) == 1
    check_slot_ownership(a, t, {})


def test_evict_stops_once_enough_freed():
    a, t = make()
    for i in range(5):
        put(a, t, [i, i, i])
    assert t.evict(4) == 6
    assert t.total_size() == 9
    assert t.evict(0) == 0


def test_eviction_does_not_walk_the_whole_tree(monkeypatch):
    # On a full pool every step evicts a few tokens. A walk over every node per
    # call made each step cost ~20 ms at 12k nodes, and a server slowed to a
    # crawl once its pool filled. Candidates now live in a heap kept across calls.
    a, t = make(num_slots=4 * 3000 + 8)
    for i in range(3000):
        put(a, t, [i % 7, i, i, i])  # 7 shared first tokens, 3000 leaves below them
    t.match_prefix([0, 0, 0, 0])  # the oldest leaf becomes the newest
    locked = t.match_prefix([1, 1, 1, 1]).node
    t.lock(locked)  # the next oldest may not go

    def walk(self):
        raise AssertionError("evict walked the whole tree")

    monkeypatch.setattr(RadixCache, "_nodes", walk)
    assert t.evict(30) == 30  # ten leaves of 3 tokens each
    monkeypatch.undo()
    gone = [i for i in range(3000) if t.match_prefix([i % 7, i, i, i]).length < 4]
    assert gone == list(range(2, 12))  # least recently used first, the locked one and the touched one skipped
    t.unlock(locked)
    t.check()  # also asserts that every unlocked leaf is still a candidate


def test_disable_mode():
    a, t = make(disable=True)
    s = a.alloc(3)
    assert t.insert([1, 2, 3], s) == 0
    m = t.match_prefix([1, 2, 3])
    assert m.length == 0 and m.node is t.root
    t.lock(m.node)
    t.unlock(m.node)
    assert t.evict(10) == 0
    assert t.total_size() == 0 and t.check().numel() == 0
    # The tree owns nothing: the caller still owns (and frees) all of s.
    check_slot_ownership(a, t, {"req": s})
    a.free(s)
    check_slot_ownership(a, t, {})


def test_reset():
    a, t = make()
    put(a, t, [1, 2, 3])
    t.lock(t.match_prefix([1, 2]).node)
    t.reset()
    a.reset()
    assert t.total_size() == 0 and num_nodes(t) == 0
    check_slot_ownership(a, t, {})


def test_check_detects_corruption():
    a, t = make()
    put(a, t, [1, 2, 3])
    put(a, t, [1, 2, 4])
    node = t.match_prefix([1, 2]).node
    node.lock_ref = 1  # a lock taken without going through lock()
    with pytest.raises(AssertionError, match="lock_ref"):
        t.check()
    node.lock_ref = 0
    t.check()
    leaf = node.children[3]
    leaf.value = torch.tensor([0])
    with pytest.raises(AssertionError, match="slot 0"):
        t.check()
    leaf.value = node.children[4].value.clone()
    with pytest.raises(AssertionError, match="twice"):
        t.check()
    leaf.value = torch.tensor([60, 61])
    with pytest.raises(AssertionError, match="length mismatch"):
        t.check()


def test_long_prompt_match_is_fast():
    # 32k-token prompt, shared prefix: matching must not be per-token Python work
    # across a deep chain of tiny nodes.
    import time

    a, t = make(num_slots=70_000)
    prompt = list(range(32_000))
    put(a, t, prompt)
    put(a, t, prompt[:16_000] + [-1] * 100)
    t0 = time.perf_counter()
    for _ in range(20):
        assert t.match_prefix(prompt).length == 32_000
    assert (time.perf_counter() - t0) / 20 < 0.05
    check_slot_ownership(a, t, {})
