"""Held-out next-token agreement of a trained head with the target, per evaluation domain.

Agreement = top-1 of the head's draft (``lm_head(head(h_t, x_{t+1}))``) equals the target's own top-1 for
the same token (``lm_head(h_{t+1})``), over the assistant tokens of the held-out conversations of each
mixture (by default ``math`` and ``chat``), with true target features as input (the first draft step).
``acc_j`` for j >= 1 repeats it with the HASS harmonized context of j earlier draft predictions, i.e. the
agreement one would see at draft depth j+1 — reported for both head kinds, so HASS's gain is visible.

The held-out rule (trainer.split_examples) is the same for every mixture, so no head was trained on any
conversation scored here.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Sequence

import torch

from taps_ray.config import StudyConfig
from taps_ray.data.draft_vocab import draft_vocabulary
from taps_ray.fsio import atomic_write_json
from taps_ray.models.draft_head import DraftHead
from taps_ray.models.target import Target, load_target
from taps_ray.training.features import Entry, FeatureSet, extract_features, features_key
from taps_ray.training.losses import FrozenTarget, LossSettings
from taps_ray.training.trainer import configure_threads, evaluate, heldout_batches, split_examples, stream_batches
from taps_ray.workdir import agreement_cache, head_checkpoint, in_workdir

DEFAULT_DOMAINS = ("math", "chat")


def heldout_entries(cfg: StudyConfig, mixture_name: str, target: Target | None = None,
                    progress: bool = False) -> tuple[FeatureSet, list[Entry]]:
    """The mixture's feature set and its held-out conversations (their features stay on disk until streamed)."""
    features = extract_features(cfg, mixture_name, target=target, progress=progress)
    _, held = split_examples(features.entries(), cfg.train.heldout_fraction, cfg.train.seed)
    return features, held


def evaluate_agreement(cfg: StudyConfig, head_path: str | Path, corpus_mixture: str | Sequence[str] = DEFAULT_DOMAINS,
                       *, target: Target | None = None, passes: int | None = None, progress: bool = False) -> dict:
    """{mixture: {"acc": top-1 agreement, "acc_j": at simulated depth j+1, "loss": EAGLE loss, "tokens": n}}
    for each held-out mixture in `corpus_mixture` (a name or a list of names)."""
    configure_threads()
    domains = [corpus_mixture] if isinstance(corpus_mixture, str) else list(corpus_mixture)
    if target is None:
        target = load_target(cfg.target)
    head = DraftHead.load(head_path, torch.float32, device=target.device)
    vocab = draft_vocabulary(cfg, target.tokenizer, target.stop_token_ids)
    frozen = FrozenTarget.from_model(target.model, torch.float32, vocab)
    settings = LossSettings.for_kind("eagle2", cfg.train)
    n_passes = passes if passes is not None else max(1, cfg.train.hca_passes)
    out: dict = {"head": in_workdir(cfg, head_path), "kind": head.config.kind, "trained_on": head.config.trained_on}
    for name in domains:
        features, held = heldout_entries(cfg, name, target, progress)
        batches = stream_batches(features, heldout_batches(held, cfg.train.eval_batch_size, cfg.train.shuffle_shards))
        result = evaluate(head, batches, frozen, settings, passes=n_passes)
        out[name] = {
            "acc": result.get("acc"),
            **{f"acc_{j}": result.get(f"acc_{j}") for j in range(n_passes)},
            "loss": result.get("loss0"),
            "tokens": int(result.get("scored_tokens", 0)),
            "conversations": len(held),
        }
    return out


def agreement_file(cfg: StudyConfig, head_path: str | Path, domains: Sequence[str] = DEFAULT_DOMAINS) -> Path:
    """Where the head's held-out agreement is remembered: ``<head>/agreement-<key>.json``.

    The key covers the head's weights, the held-out feature sets, the held-out rule and the number of passes, so a
    retrained head or changed data is evaluated afresh.
    """
    head_path = Path(head_path)
    spec = {
        "weights": hashlib.sha256((head_path / "model.safetensors").read_bytes()).hexdigest()[:16],
        "features": [features_key(cfg, d) for d in domains],
        "heldout": [cfg.train.heldout_fraction, cfg.train.seed],
        "passes": max(1, cfg.train.hca_passes),
        "mask": cfg.train.mask_alignment,
        "draft_vocab_size": cfg.tree.draft_vocab_size,
    }
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    return agreement_cache(head_path, key)


def read_agreement(cfg: StudyConfig, head_path: str | Path, domains: Sequence[str] = DEFAULT_DOMAINS) -> dict | None:
    """The remembered agreement of the head, or None when it was not measured for today's head and data."""
    cache = agreement_file(cfg, head_path, domains)
    return json.loads(cache.read_text()) if cache.is_file() else None


def cached_agreement(cfg: StudyConfig, head_path: str | Path, domains: Sequence[str] = DEFAULT_DOMAINS, *,
                     target: Target | None = None) -> dict:
    """evaluate_agreement, remembered in the head's folder (`agreement_cache`): a rerun costs nothing."""
    remembered = read_agreement(cfg, head_path, domains)
    if remembered is not None:
        return remembered
    result = evaluate_agreement(cfg, head_path, list(domains), target=target)
    atomic_write_json(agreement_file(cfg, head_path, domains), result)
    return result


def head_finals(cfg: StudyConfig) -> list[tuple[str, str, Path]]:
    """(kind, mixture, final checkpoint folder) of every head the study trains (`StudyConfig.head_pairs`), trained
    or not."""
    return [(kind, mixture, head_checkpoint(cfg, kind, mixture)) for kind, mixture in cfg.head_pairs()]


def trained_heads(cfg: StudyConfig) -> dict[str, Path]:
    """{"<kind>-<mixture>": final checkpoint folder} of the heads that have one."""
    return {f"{kind}-{mixture}": final for kind, mixture, final in head_finals(cfg)
            if (final / "model.safetensors").is_file()}


def unmeasured_heads(cfg: StudyConfig, domains: Sequence[str] = DEFAULT_DOMAINS) -> list[str]:
    """The trained heads whose held-out agreement is not remembered yet."""
    return [label for label, path in trained_heads(cfg).items() if read_agreement(cfg, path, domains) is None]


def measure_agreement(cfg: StudyConfig, target: Target | None = None,
                      domains: Sequence[str] = DEFAULT_DOMAINS) -> dict[str, dict[str, float | None]]:
    """Measure (or reuse) the held-out agreement of every trained head, so that the heads report only reads it.

    Run after training (the sweep's train stage, `taps agreement`); returns {head: {domain: depth-1 agreement}}.
    """
    out = {}
    for label, path in trained_heads(cfg).items():
        if target is None and read_agreement(cfg, path, domains) is None:
            target = load_target(cfg.target)
        agreement = cached_agreement(cfg, path, domains, target=target)
        out[label] = {d: agreement[d]["acc"] for d in domains}
    return out
