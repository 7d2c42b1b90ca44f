"""KV-cache layer: slot allocator, physical KV pool, req->token table, radix prefix cache."""

from .allocator import SlotAllocator
from .check import check_slot_ownership
from .pool import ReqToTokenPool, TokenKVPool
from .radix import MatchResult, RadixCache, TreeNode

__all__ = [
    "MatchResult",
    "RadixCache",
    "ReqToTokenPool",
    "SlotAllocator",
    "TokenKVPool",
    "TreeNode",
    "check_slot_ownership",
]
