"""Which forward a target's batches verify with (`target.forward` in the config): taps' fast forward where it
covers the architecture (Llama, Mistral, Qwen2, Qwen3), transformers' decoder otherwise (which refuses, at load,
what it cannot decode exactly; docs/targets.md).

The choice travels with the model object (`attach_forward` at load time), so every `TargetBatch` built on it,
in-process, in Serve or in a Ray verification actor, runs the same forward without threading a setting through
each caller; a model that was not loaded through `load_target` gets transformers' forward.
`target.compile: inductor` builds the fast forward's compiled path (models/fast_llama.py), `step` its captured
decode step (decoding/captured_step.py); where they cannot run
(transformers' forward, no C++ compiler for inductor's CPU code, no Triton on a GPU) the forward runs eager and
a log line says why and what to install.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
from torch import nn

from taps_ray.models.fast_llama import FastLlama, unsupported_reason
from taps_ray.models.hf_forward import HFForward

ForwardKind = Literal["fast", "hf"]
CompileMode = Literal["auto", "none", "inductor", "step"]
TargetForward = FastLlama | HFForward
_ATTRIBUTE = "taps_target_forward"

log = logging.getLogger(__name__)


def compile_unavailable_reason(device: torch.device) -> str | None:
    """Why inductor cannot generate code for `device` here, naming the fix (None: it can). Its modules are imported
    here, not with this module: they cost ~1 s and a drafter, which imports the target's module, never compiles."""
    from torch._inductor import cpp_builder
    from torch.utils._triton import has_triton

    if device.type == "cpu":
        try:
            cpp_builder.get_cpp_compiler()  # what inductor itself calls before writing its C++ kernels
        except Exception as error:  # noqa: BLE001 - inductor raises several kinds for a missing or broken compiler
            return (f"inductor's CPU code needs a C++ compiler ({error}); install one (Debian: apt-get install g++, "
                    "or set CXX) or set target.compile: none")
    elif device.type == "cuda" and not has_triton():
        return "inductor's GPU code needs Triton; install the triton package matching torch or set target.compile: none"
    return None


def resolved_compile(compile_mode: CompileMode, device: torch.device, fast: bool, serving: bool = False
                     ) -> CompileMode:
    """`auto` as what measured fastest on the device: taps' fast forward's captured step on a GPU (2.1x eager at
    batch 1, 1.4x at 16 on the 8B shape, H200: reports/gpu.md); on a CPU its layer graph for a Serve replica
    (`serving`: long-lived, it compiles once at start-up; 1.1-1.2x eager's step at batch 1-16 in bf16; in fp32
    served under vLLM's client 1.06x eager at 16 in flight, docs/serve.md), eager for everything else, whose runs
    are too short to earn back the compiling; transformers' forward eager; other modes as given."""
    if compile_mode != "auto" or not fast:
        return compile_mode if compile_mode != "auto" else "none"
    if device.type == "cuda":
        log.info("target.compile auto: the captured decode step on the GPU (each shape bucket compiles on first "
                 "use, ~40 s on an H200; target.compile: none runs eager)")
        return "step"
    return "inductor" if serving and device.type == "cpu" else "none"


def attach_forward(model: nn.Module, kind: ForwardKind, compile_mode: CompileMode = "none",
                   serving: bool = False) -> TargetForward:
    """Build the forward `kind` for `model` (fast falls back to hf, with a log line, where it does not cover the
    architecture), compiled if asked and possible, and attach it to the model for `target_forward`. `serving`:
    for a Serve replica (what `auto` resolves to)."""
    reason = unsupported_reason(model) if kind == "fast" else None
    if reason is not None:
        log.info("target.forward fast does not cover this target (%s): using transformers' forward", reason)
    fast = kind == "fast" and reason is None
    compile_mode = resolved_compile(compile_mode, model.device, fast, serving)
    compiled = compile_mode != "none"
    if compiled and not fast:
        log.warning("target.compile %s compiles taps' fast forward only: transformers' forward runs eager",
                    compile_mode)
        compiled = False
    elif compiled and (missing := compile_unavailable_reason(model.device)) is not None:
        log.warning("target.compile %s cannot run: %s; the forward runs eager", compile_mode, missing)
        compiled = False
    captured = "compile" if compiled and compile_mode == "step" else None
    forward: TargetForward = (FastLlama(model, compiled=compiled and compile_mode == "inductor", captured=captured)
                              if fast else HFForward(model))
    object.__setattr__(model, _ATTRIBUTE, forward)  # a plain attribute: not a submodule, not in the state dict
    return forward


def target_forward(model: nn.Module) -> TargetForward:
    """The forward attached to `model`, or transformers' for a model loaded elsewhere."""
    forward = getattr(model, _ATTRIBUTE, None)
    return forward if forward is not None else attach_forward(model, "hf")
