"""Several draft heads of one shape as one `DraftHead` whose batch row n runs head n.

A router drafts every head from the same committed inputs each step; on a CPU a draft pass costs mostly the
fixed overhead of many small ops, so drafting N heads one after the other costs N passes. A `StackedHead`
keeps the head's forward code unchanged and swaps only the weights: every `nn.Linear` becomes a
`StackedLinear` (one batched matmul over the heads) and every RMSNorm weight becomes [N, 1, d], which
broadcasts over a [N, T, d] input. Batch row n of `step` is then exactly head n's computation, and the
N heads draft in one forward per tree level.

A stack copies the heads' weights when it is built (for drafting only: it is never trained or saved).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from taps_ray.models.draft_head import DraftHead
from taps_ray.models.llama_blocks import RMSNorm


class StackedLinear(nn.Module):
    """N bias-optional linear layers of one shape, layer n applied to batch row n: x [N, T, in] -> [N, T, out].

    The weights keep nn.Linear's [out, in] layout per head, so the batched matmul multiplies as F.linear does."""

    def __init__(self, linears: Sequence[nn.Linear]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.stack([layer.weight.detach() for layer in linears]), requires_grad=False)
        biases = [layer.bias for layer in linears]
        self.bias = None if biases[0] is None else nn.Parameter(
            torch.stack([b.detach() for b in biases])[:, None], requires_grad=False)  # [N, 1, out]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return torch.bmm(x, self.weight.mT)
        return torch.baddbmm(self.bias, x, self.weight.mT)


def stack_mismatch(heads: Sequence[DraftHead]) -> str | None:
    """Why `heads` cannot draft as one `StackedHead`, or None when they can: EAGLE-2/HASS heads of one
    configuration (apart from `trained_on`), on one device in one dtype."""
    if len(heads) < 2:
        return f"a stack needs at least two heads, got {len(heads)}"
    configs = {h.config.model_copy(update={"trained_on": ""}).model_dump_json() for h in heads}
    if len(configs) > 1:
        return "the heads' configurations differ"
    if heads[0].eagle3:
        return "EAGLE-3 heads draft through their own LM heads and vocabularies"
    placements = {(p.device, p.dtype) for h in heads for p in h.parameters()}
    if len(placements) > 1:
        return f"the heads' weights lie on different devices or dtypes: {sorted(map(str, placements))}"
    return None


class StackedHead(DraftHead):
    """The heads `heads` as one module over a batch of `stacked` rows (see the module docstring)."""

    def __init__(self, heads: Sequence[DraftHead]) -> None:
        reason = stack_mismatch(heads)
        if reason is not None:
            raise ValueError(f"cannot stack draft heads: {reason}")
        with torch.device("meta"):  # every weight is replaced below
            super().__init__(heads[0].config)
        self.stacked = len(heads)
        for name, module in list(self.named_modules()):
            parent, _, attribute = name.rpartition(".")
            if isinstance(module, nn.Linear):
                stacked = StackedLinear([h.get_submodule(name) for h in heads])
                setattr(self.get_submodule(parent), attribute, stacked)
            elif isinstance(module, RMSNorm):
                weights = torch.stack([h.get_submodule(name).weight.detach() for h in heads])[:, None]  # [N, 1, d]
                module.weight = nn.Parameter(weights, requires_grad=False)
        self.rotary = copy.deepcopy(heads[0].rotary)  # the same positions rotate every head alike
        self.eval()
