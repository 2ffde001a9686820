"""Drafters: sources of draft tokens for exact speculative decoding (see base.Drafter)."""
from agentrt.spec.drafters.base import Draft, Drafter, DraftRequest
from agentrt.spec.drafters.null import NullDrafter
from agentrt.spec.drafters.suffix import SuffixConfig, SuffixDrafter, SuffixTrie

__all__ = [
    "Draft",
    "DraftRequest",
    "Drafter",
    "NullDrafter",
    "SuffixConfig",
    "SuffixDrafter",
    "SuffixTrie",
]
