"""Which forward a target's batches verify with (`target.forward` in the config): taps' fast Llama forward where
it covers the architecture, transformers' model otherwise.

The choice travels with the model object (`attach_forward` at load time), so every `TargetBatch` built on it,
in-process, in Serve or in a Ray verification actor, runs the same forward without threading a setting through
each caller; a model that was not loaded through `load_target` gets transformers' forward.
"""

from __future__ import annotations

import logging
from typing import Literal

from torch import nn

from taps_ray.models.fast_llama import FastLlama, unsupported_reason
from taps_ray.models.hf_forward import HFForward

ForwardKind = Literal["fast", "hf"]
TargetForward = FastLlama | HFForward
_ATTRIBUTE = "taps_target_forward"

log = logging.getLogger(__name__)


def attach_forward(model: nn.Module, kind: ForwardKind) -> TargetForward:
    """Build the forward `kind` for `model` (fast falls back to hf, with a log line, where it does not cover the
    architecture) and attach it to the model for `target_forward`."""
    reason = unsupported_reason(model) if kind == "fast" else None
    if reason is not None:
        log.info("target.forward fast does not cover this target (%s): using transformers' forward", reason)
    forward: TargetForward = FastLlama(model) if kind == "fast" and reason is None else HFForward(model)
    object.__setattr__(model, _ATTRIBUTE, forward)  # a plain attribute: not a submodule, not in the state dict
    return forward


def target_forward(model: nn.Module) -> TargetForward:
    """The forward attached to `model`, or transformers' for a model loaded elsewhere."""
    forward = getattr(model, _ATTRIBUTE, None)
    return forward if forward is not None else attach_forward(model, "hf")
