"""Decoding: verifying draft trees against the target and committing tokens (the loop, batching, replay)."""
