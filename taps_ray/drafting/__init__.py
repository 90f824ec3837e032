"""Drafting: what proposes a draft tree (EAGLE-2 heads, their combinations, prompt lookup, the cost model, names)."""
