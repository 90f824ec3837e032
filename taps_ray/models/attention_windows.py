"""Sliding-window attention for both target forwards: how far back each layer sees, and the masks that say so.

Why: the batch's masks (decoding/target_batch.py) say which cache slots a query may attend for full attention. A
sliding-window layer (Mistral, Phi-3, Qwen2/3 with `use_sliding_window`, Gemma's alternating layers) sees only the
last `window` positions, and transformers applies that window only to masks it builds itself, never to a 4-D mask
handed to it. Since a sequence's committed slot i holds its position i and the forward's new slots hold its
`positions`, the window is one comparison of positions, applied the same way by taps' fast forward and
transformers' (`models/hf_forward.py`). A window no position can exceed yet changes nothing and costs nothing.
"""

from __future__ import annotations

import torch

FULL, SLIDING = "full_attention", "sliding_attention"


def layer_windows(config: object) -> list[int | None]:
    """Each layer's window (None: full attention), read as transformers' decoders read their config: `layer_types`
    where the config has them (Qwen2/3, Gemma 2/3, ...), else `sliding_window` for every layer (Mistral, Phi-3).
    A layer type other than full or sliding attention raises (`UnsupportedLayers`)."""
    layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not types:
        return [window] * layers
    others = sorted({kind for kind in types if kind not in (FULL, SLIDING)})
    if others:
        raise UnsupportedLayers(others)
    if SLIDING in types and not window:
        raise UnsupportedLayers([f"{SLIDING} without a sliding_window"])
    return [window if kind == SLIDING else None for kind in types[:layers]]


class UnsupportedLayers(ValueError):
    """Layers neither full nor sliding-window attention (linear attention, chunked attention, state-space...)."""

    def __init__(self, kinds: list[str]) -> None:
        super().__init__(f"{', '.join(kinds)} layers")


def causal_mask(past: int, length: int, device: torch.device) -> torch.Tensor:
    """[1, 1, T, past + T]: query i sees the cache and queries 0..i (the mask a None mask stands for)."""
    columns = torch.arange(past + length, device=device)
    return (columns[None, :] <= past + torch.arange(length, device=device)[:, None])[None, None]


def windowed_masks(mask: torch.Tensor | None, positions: torch.Tensor, past: int, windows: set[int | None]
                   ) -> dict[int | None, torch.Tensor | None]:
    """The forward's mask for each window in `windows`: `mask` ([B, 1, T, S] boolean, or None for causal after
    the cache) further limited to keys fewer than `window` positions before the query (transformers' rule,
    `kv_idx > q_idx - window`). A window at least as wide as the furthest position reached keeps `mask`."""
    length = positions.shape[1]
    masks: dict[int | None, torch.Tensor | None] = {}
    for window in windows:
        if window is None or past + length <= window:  # every position is < past + length
            masks[window] = mask
            continue
        base = mask if mask is not None else causal_mask(past, length, positions.device)
        committed = torch.arange(past, device=positions.device).expand(positions.shape[0], -1)
        keys = torch.cat([committed, positions], dim=1)  # [B, S]: slot i < past holds position i
        near = (positions[:, None, :, None] - keys[:, None, None, :]) < window
        masks[window] = base & near
    return masks
