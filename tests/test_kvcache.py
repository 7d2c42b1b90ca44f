"""Unit tests: SlotAllocator, TokenKVPool, ReqToTokenPool, check_slot_ownership."""

from __future__ import annotations

import pytest
import torch

from stepserve.kvcache import (
    RadixCache,
    ReqToTokenPool,
    SlotAllocator,
    TokenKVPool,
    check_slot_ownership,
)

# ---------------------------------------------------------------- allocator


def test_alloc_returns_distinct_int64_slots_never_zero():
    a = SlotAllocator(8)
    assert a.num_slots == 8 and a.available() == 7
    s = a.alloc(7)
    assert s.dtype == torch.int64 and s.device.type == "cpu" and s.shape == (7,)
    assert sorted(s.tolist()) == list(range(1, 8))
    assert a.available() == 0


def test_alloc_none_when_short_allocates_nothing():
    a = SlotAllocator(5)
    s = a.alloc(3)
    assert a.alloc(2) is None
    assert a.available() == 1  # the failed call took nothing
    assert a.alloc(1).tolist() == [4]
    a.free(s)
    assert a.alloc(4) is None
    assert a.available() == 3


def test_alloc_zero_and_negative():
    a = SlotAllocator(3)
    assert a.alloc(0).numel() == 0
    with pytest.raises(ValueError):
        a.alloc(-1)


def test_free_is_lazy_and_reused():
    a = SlotAllocator(6)
    s1, s2 = a.alloc(2), a.alloc(3)
    a.free(torch.empty(0, dtype=torch.int64))  # empty is fine
    a.free(s2)
    a.free(s1)
    assert a.available() == 5
    assert len(a._pending) == 2  # not concatenated yet
    got = a.alloc(5)
    assert sorted(got.tolist()) == [1, 2, 3, 4, 5]
    assert a._pending == []


def test_slots_freed_last_are_handed_out_first_so_those_in_use_stay_compact():
    """A server that keeps at most 24 tokens live, one request after another
    with its decode slots taken a step at a time, touches about 24 slots of
    a 10,000-slot pool, not the whole pool: the slots freed last go out
    first (across chunks, and a chunk split where a request takes part of
    it), the never-used ones only when none are free."""
    import random

    rng = random.Random(0)
    a = SlotAllocator(10_000)
    live: list[torch.Tensor] = []
    touched: set[int] = set()
    for _ in range(2_000):
        if sum(t.numel() for t in live) + 4 <= 24 and rng.random() < 0.6:
            got = a.alloc(rng.randint(1, 4))
            touched.update(got.tolist())
            live.append(got)
        elif live:
            a.free(live.pop(rng.randrange(len(live))))
    assert len(touched) <= 27, len(touched)
    held = torch.cat(live) if live else torch.empty(0, dtype=torch.int64)
    assert sorted(held.tolist() + a.free_slots().tolist()) == list(range(1, 10_000))


def test_compact_puts_the_free_slots_back_in_order_as_in_a_fresh_pool():
    """After churn a request's slots come from chunks freed in any order;
    `compact` hands out contiguous ascending runs again, around the slots
    still held, and loses or duplicates none."""
    import random

    rng = random.Random(1)
    a = SlotAllocator(1_000)
    chunks = [a.alloc(rng.randint(1, 30)) for _ in range(30)]
    rng.shuffle(chunks)
    held = chunks.pop()
    for c in chunks:
        a.free(c)
    taken = a.alloc(40)
    assert taken.tolist() != sorted(taken.tolist())  # scattered: the newest freed chunks first
    a.compact()
    free = a.free_slots().tolist()
    assert free == sorted(free) and len(free) == a.available()
    got = a.alloc(50).tolist()
    assert got == free[:50]
    assert sorted(held.tolist() + taken.tolist() + got + a.free_slots().tolist()) == list(range(1, 1_000))


def test_free_copies_so_caller_can_reuse_its_buffer():
    a = SlotAllocator(6)
    table = torch.zeros(8, dtype=torch.int64)
    table[:3] = a.alloc(3)
    a.free(table[:3])
    table[:3] = 0  # the row is reused by someone else
    assert sorted(a.free_slots().tolist()) == [1, 2, 3, 4, 5]


def test_free_slots_and_reset():
    a = SlotAllocator(6)
    s = a.alloc(4)
    a.free(s[:2])
    assert sorted(a.free_slots().tolist()) == sorted([5, *s[:2].tolist()])
    a.reset()
    assert a.available() == 5
    assert sorted(a.free_slots().tolist()) == [1, 2, 3, 4, 5]


def test_num_slots_one_has_nothing_usable():
    a = SlotAllocator(1)
    assert a.available() == 0 and a.alloc(1) is None
    with pytest.raises(ValueError):
        SlotAllocator(0)


# --------------------------------------------------------------------- pools


def test_req_to_token_pool():
    p = ReqToTokenPool(max_rows=3, max_context=16)
    assert p.table.shape == (3, 16) and p.table.dtype == torch.int64
    assert int(p.table.abs().sum()) == 0
    rows = [p.alloc(), p.alloc(), p.alloc()]
    assert rows == [0, 1, 2] and p.available() == 0
    assert p.alloc() is None
    p.free(1)
    assert p.available() == 1
    with pytest.raises(ValueError):
        p.free(1)  # double free
    with pytest.raises(ValueError):
        p.free(7)
    assert p.alloc() == 1
    p.reset()
    assert p.available() == 3


def test_req_to_token_pool_write_sets_one_entry_per_row():
    """`write` (a decode step's new slots, through the table's numpy view)
    sets table[row, position] and nothing else."""
    p = ReqToTokenPool(max_rows=4, max_context=8)
    p.table[:] = -1
    p.write([2, 0, 3], [5, 0, 7], torch.tensor([11, 12, 13]))
    want = torch.full((4, 8), -1, dtype=torch.int64)
    want[2, 5], want[0, 0], want[3, 7] = 11, 12, 13
    assert torch.equal(p.table, want)


def test_token_kv_pool_write_and_sizes():
    pool = TokenKVPool(
        num_slots=10, num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float16, device="cpu"
    )
    assert len(pool.k_buffers) == len(pool.v_buffers) == 2
    assert pool.k_buffers[0].shape == (10, 2, 4) and pool.k_buffers[0].dtype == torch.float16
    slots = torch.tensor([3, 7, 1])
    k = torch.randn(3, 2, 4)  # float32 in, stored as float16
    v = torch.randn(3, 2, 4)
    pool.write(1, slots, k, v)
    torch.testing.assert_close(pool.k_buffers[1][slots], k.half())
    torch.testing.assert_close(pool.v_buffers[1][slots], v.half())
    assert int(pool.k_buffers[0].abs().sum()) == 0  # other layer untouched
    # padded rows may write slot 0 several times
    pool.write(0, torch.tensor([0, 0]), torch.ones(2, 2, 4), torch.ones(2, 2, 4))
    assert TokenKVPool.bytes_per_slot(2, 2, 4, torch.float16) == 2 * 2 * 2 * 4 * 2
    assert TokenKVPool.bytes_per_slot(32, 8, 128, torch.bfloat16) == 131072
    assert pool.total_bytes() == 10 * 64


# ------------------------------------------------------ check_slot_ownership


def _setup():
    a = SlotAllocator(12)
    tree = RadixCache(a)
    s = a.alloc(4)
    tree.insert([1, 2, 3, 4], s)
    mine = a.alloc(3)
    return a, tree, mine


def test_ownership_ok():
    a, tree, mine = _setup()
    check_slot_ownership(a, tree, {"req0": mine})


def test_ownership_catches_leak():
    a, tree, mine = _setup()
    with pytest.raises(AssertionError, match=r"leaked slot\(s\).*\[" + str(int(mine[1]))):
        check_slot_ownership(a, tree, {"req0": mine[[0, 2]]})


def test_ownership_catches_double_owner():
    a, tree, mine = _setup()
    tree_slot = int(tree.check()[0])
    with pytest.raises(AssertionError) as e:
        check_slot_ownership(a, tree, {"req0": mine, "req1": torch.tensor([tree_slot])})
    msg = str(e.value)
    assert f"slot {tree_slot}: tree, owner 'req1'" in msg


def test_ownership_catches_double_free_and_slot_zero():
    a, tree, mine = _setup()
    a.free(mine[:1])
    with pytest.raises(AssertionError, match=rf"slot {int(mine[0])}: free list, owner 'r'"):
        check_slot_ownership(a, tree, {"r": mine})
    a2, tree2, mine2 = _setup()
    a2.free(mine2)
    a2.free(mine2[:1])
    with pytest.raises(AssertionError, match=r"free list x2"):
        check_slot_ownership(a2, tree2, {})
    a3, tree3, mine3 = _setup()
    with pytest.raises(AssertionError, match="invalid slot"):
        check_slot_ownership(a3, tree3, {"r": torch.cat([mine3, torch.tensor([0])])})
