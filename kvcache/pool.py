"""Physical KV storage and the per-request token->slot table.

`TokenKVPool` holds the K/V tensors, one pair per layer, indexed by slot, on
the model's device. `ReqToTokenPool` maps (running request row, token
position) -> slot, which is what attention kernels gather through; it lives on
the host, with the slot allocator and the radix tree, so that the scheduler's
bookkeeping never launches device work. A backend on a GPU sends each step
what it reads of the table (flashinfer: the page lists), as vLLM sends its
block tables.
"""

from __future__ import annotations

import torch


class TokenKVPool:
    """Per-layer K and V buffers of shape [num_slots, num_kv_heads, head_dim].

    Row 0 is the padding slot (see SlotAllocator); it is allocated like any other
    row so that writes of padded tokens land somewhere valid.
    """

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device,
    ):
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_slots, num_kv_heads, head_dim)
        # zeros, not empty: the padding slot is read by padded decode rows, and
        # uninitialised memory could hold NaN/Inf that leaks through a 0 weight
        # (0 * NaN = NaN) in kernels that do not mask before the matmul.
        self.k_buffers: list[torch.Tensor] = [
            torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)
        ]
        self.v_buffers: list[torch.Tensor] = [
            torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)
        ]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store this step's k, v [T, kv_heads, head_dim] at `slots` [T]."""
        kb, vb = self.k_buffers[layer], self.v_buffers[layer]
        # index_copy_ rather than `kb[slots] = k`: on CPU advanced-index
        # assignment is ~3x slower. Repeated slot 0 from padded rows is fine:
        # which write wins there does not matter.
        kb.index_copy_(0, slots, k.to(kb.dtype))
        vb.index_copy_(0, slots, v.to(vb.dtype))

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[layer], self.v_buffers[layer]

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one token costs across all layers (K and V), for sizing the pool."""
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    def total_bytes(self) -> int:
        return self.num_slots * self.bytes_per_slot(
            self.num_layers, self.num_kv_heads, self.head_dim, self.dtype
        )


class ReqToTokenPool:
    """`table[row, pos]` = KV slot of token `pos` of the sequence running in `row`
    (an int64 tensor on the host).

    Rows are recycled; a freshly allocated row still holds whatever its previous
    owner wrote (it is not cleared, to keep `free` a pure bookkeeping call).
    Callers write every position they later read.
    """

    @staticmethod
    def rows_for(max_running: int) -> int:
        """The rows an engine capped at `max_running` sequences keeps: room for
        the forks of n > 1 requests admitted under the cap, and for the
        sequences of a retraction's requeue."""
        return max_running * 2 + 8

    def __init__(self, max_rows: int, max_context: int):
        self.max_rows = max_rows
        self.max_context = max_context
        self.table = torch.zeros((max_rows, max_context), dtype=torch.int64)
        # a numpy view of the table: a decode step writes one slot per row, and numpy's fancy
        # assignment costs a fraction of torch's advanced-index put (~8 against ~30 us)
        self._host = self.table.numpy()
        # Stack with row 0 on top, so rows are handed out in order 0, 1, 2, ...
        self._free_rows: list[int] = list(range(max_rows - 1, -1, -1))
        self._used: set[int] = set()

    def available(self) -> int:
        return len(self._free_rows)

    def write(self, rows: list[int], positions: list[int], slots: torch.Tensor) -> None:
        """table[rows[i], positions[i]] = slots[i] (one entry per row: a decode step's new tokens)."""
        self._host[rows, positions] = slots.numpy()

    def alloc(self) -> int | None:
        if not self._free_rows:
            return None
        row = self._free_rows.pop()
        self._used.add(row)
        return row

    def free(self, row: int) -> None:
        # Double frees would hand one row to two requests later: fail loudly.
        if row not in self._used:
            raise ValueError(f"ReqToTokenPool.free: row {row} is not allocated")
        self._used.remove(row)
        self._free_rows.append(row)

    def reset(self) -> None:
        self._free_rows = list(range(self.max_rows - 1, -1, -1))
        self._used.clear()
