"""Token-slot allocator for the KV pool (page size 1: one slot holds one token).

Slots are int64 indices into the per-layer K/V buffers of `TokenKVPool`, kept
on the host whatever the pool's device (see `pool.py`).
Slot 0 is reserved as the padding slot: it is never handed out and never taken
back, so padded rows of a batch can point (and even write) there harmlessly.
"""

from __future__ import annotations

import torch


class SlotAllocator:
    """Free list of KV slots 1..num_slots-1.

    `free` is on the hot path (every finished request, every evicted leaf), so it
    only appends the chunk to a pending list. `alloc` hands out the slots
    freed last first (the newest chunks), then the never-used ones in order:
    the slots in use stay within about the peak number live, where the memory
    is warm in the caches and the TLB. Handing out the oldest free slots first
    walked the whole pool, and once it had gone round, every request's KV lay
    in slots freed long before, scattered over the pool. Two servers on the
    embedded model (1 GiB pool, 262k slots, 2-core Xeon), replaying fork/join
    traces in turn at 24 req/s: over replays 6-16 (past the point where the
    radix cache has filled the pool) TPOT p50 0.81 ms against 0.87 (p90 1.60
    against 1.72), lower in 11 of 11; over the first five 0.68 against 0.70.
    Both still slow down once the pool is full (0.68 -> 0.82 ms), when every
    slot comes from an evicted least-recently-used leaf.
    """

    device = torch.device("cpu")

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1 (slot 0 is the padding slot), got {num_slots}")
        self.num_slots = num_slots
        self.reset()

    def reset(self) -> None:
        # Everything but the padding slot is free again. Pending chunks are
        # dropped: after a reset nobody owns anything.
        self._free = torch.arange(1, self.num_slots, dtype=torch.int64, device=self.device)
        self._pending: list[torch.Tensor] = []
        self._pending_count = 0

    def available(self) -> int:
        return self._free.numel() + self._pending_count

    def _merge(self) -> None:
        if self._pending:
            self._free = torch.cat([*reversed(self._pending), self._free])
            self._pending = []
            self._pending_count = 0

    def alloc(self, n: int) -> torch.Tensor | None:
        """Take `n` free slots (int64 [n], on the host): the newest freed
        chunks first, then the never-used slots (see the class docstring).

        Returns None, allocating nothing, when fewer than `n` are free: the caller
        decides whether to evict from the radix cache and retry.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        if n > self.available():
            return None
        if n == 0:
            return self._free[:0]
        # Views are fine: a chunk or `_free` is never written in place, only
        # re-sliced or replaced, so the caller's slots and the free ones never alias.
        pending = self._pending
        parts = []
        need = n
        while need and pending:
            last = pending[-1]
            if last.numel() <= need:
                parts.append(pending.pop())
                need -= last.numel()
            else:
                parts.append(last[last.numel() - need:])
                pending[-1] = last[:last.numel() - need]
                need = 0
        self._pending_count -= n - need
        if need:
            parts.append(self._free[:need])
            self._free = self._free[need:]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def free(self, slots: torch.Tensor) -> None:
        """Give slots back. Accepts empty tensors. No validation (see check.py)."""
        if slots.numel() == 0:
            return
        # Copy (copy=True): callers often free a slice of the req->token table
        # and then reuse that row; a view kept in `_pending` would change
        # under us.
        chunk = slots.reshape(-1).to(device=self.device, dtype=torch.int64, copy=True)
        self._pending.append(chunk)
        self._pending_count += chunk.numel()

    def compact(self) -> None:
        """Every free slot back in ascending order, as in a fresh pool: the
        next allocations are contiguous runs from the lowest free slot, not
        the newest-freed-first order that churn has scattered over the pool
        (`Engine.flush_cache`: a flushed engine then lays out KV as a fresh one)."""
        self._merge()
        self._free = torch.sort(self._free).values

    def free_slots(self) -> torch.Tensor:
        """All free slots, as a fresh tensor (for integrity checks)."""
        self._merge()
        return self._free.clone()

    def __repr__(self) -> str:
        return f"SlotAllocator(num_slots={self.num_slots}, available={self.available()})"
