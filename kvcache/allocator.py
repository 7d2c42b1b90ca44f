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
    only appends the chunk to a pending list; the chunks are concatenated once,
    lazily, when `alloc` actually needs them. Re-concatenating the whole free
    list on every `free` would be O(free slots) per call.
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
            self._free = torch.cat([self._free, *self._pending])
            self._pending = []
            self._pending_count = 0

    def alloc(self, n: int) -> torch.Tensor | None:
        """Take `n` free slots (int64 [n], on the host).

        Returns None, allocating nothing, when fewer than `n` are free: the caller
        decides whether to evict from the radix cache and retry.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        if n > self.available():
            return None
        if n > self._free.numel():
            self._merge()
        # A view of the free list is fine: `_free` itself is never written in
        # place, only re-sliced or replaced, so the caller's slots and the
        # remaining free slots never alias.
        out = self._free[:n]
        self._free = self._free[n:]
        return out

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

    def free_slots(self) -> torch.Tensor:
        """All free slots, as a fresh tensor (for integrity checks)."""
        self._merge()
        return self._free.clone()

    def __repr__(self) -> str:
        return f"SlotAllocator(num_slots={self.num_slots}, available={self.available()})"
