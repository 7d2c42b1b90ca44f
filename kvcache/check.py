"""Whole-system slot accounting, for tests and debug builds.

Every usable slot (1..num_slots-1) must be in exactly one place: the
allocator's free list, the radix tree, or one request's private slots (those it
allocated and has not yet inserted into the tree). A slot in none of them has
leaked; a slot in two will be handed out twice and silently corrupt K/V.
"""

from __future__ import annotations

from typing import Hashable, Mapping

import torch

from .allocator import SlotAllocator
from .radix import RadixCache

_MAX_REPORTED = 20


def check_slot_ownership(
    allocator: SlotAllocator, tree: RadixCache, owned: Mapping[Hashable, torch.Tensor]
) -> None:
    """Raise AssertionError naming the offending slot(s) and where they were found."""
    n = allocator.num_slots
    sources: list[tuple[str, torch.Tensor]] = [
        ("free list", allocator.free_slots()),
        ("tree", tree.check()),  # also asserts the tree's own invariants
    ]
    sources += [(f"owner {k!r}", v) for k, v in owned.items()]

    problems: list[str] = []
    total = torch.zeros(n, dtype=torch.int64)
    per_source: list[tuple[str, torch.Tensor]] = []
    for name, slots in sources:
        s = slots.reshape(-1).to(device="cpu", dtype=torch.int64)
        bad = s[(s < 1) | (s >= n)]
        if bad.numel():
            problems.append(
                f"{name} holds invalid slot(s) {sorted(set(bad.tolist()))[:_MAX_REPORTED]} "
                f"(slot 0 is padding; usable range is 1..{n - 1})"
            )
            s = s[(s >= 1) & (s < n)]
        counts = torch.bincount(s, minlength=n)
        per_source.append((name, counts))
        total += counts

    def where(slot: int) -> str:
        parts = []
        for name, counts in per_source:
            c = int(counts[slot])
            if c:
                parts.append(name if c == 1 else f"{name} x{c}")
        return ", ".join(parts)

    total[0] = 1  # the padding slot is owned by nobody, by design
    leaked = torch.nonzero(total == 0).flatten().tolist()
    if leaked:
        problems.append(
            f"{len(leaked)} leaked slot(s) (in no free list, tree or owner): {leaked[:_MAX_REPORTED]}"
        )
    doubled = torch.nonzero(total > 1).flatten().tolist()
    if doubled:
        detail = "; ".join(f"slot {s}: {where(s)}" for s in doubled[:_MAX_REPORTED])
        problems.append(f"{len(doubled)} slot(s) owned more than once: {detail}")
    if problems:
        raise AssertionError("slot ownership violated: " + " | ".join(problems))
