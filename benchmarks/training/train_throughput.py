"""Training tokens/s of each head kind on a config's target, on batches shaped like its training batches.

Random features stand in for the cached ones (the cost of a step does not depend on their values), so no
feature extraction is needed: `python benchmarks/training/train_throughput.py --config configs/cpu.yaml --steps 6`.
One torch thread by default, as a Ray Tune trial trains.
"""

from __future__ import annotations

import argparse
import time

import torch

from taps_ray.config import load_config
from taps_ray.models.draft_head import eagle3_layers, new_head
from taps_ray.models.target import load_target
from taps_ray.training.losses import Batch, FrozenTarget, LossSettings, run_passes


def batch_like(cfg, d: int, vocab: int, length: int, aux_width: int) -> Batch:
    b = cfg.train.batch_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (b, length), generator=g)
    hidden = torch.randn(b, length, d, generator=g)
    aux = torch.randn(b, length, aux_width, generator=g)
    probs, top = torch.rand(b, length, cfg.features.top_k), torch.randint(0, vocab, (b, length, cfg.features.top_k))
    return Batch(ids, torch.ones(b, length), hidden, torch.full((b,), length), probs, top, aux)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--kinds", nargs="+", default=["eagle2", "hass", "eagle3"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--length", type=int, default=None, help="tokens per conversation (default: features.max_len/2)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--precision", choices=["fp32", "bf16-mixed", "auto"], default=None,
                        help="default: the config's train.precision")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    if args.precision:
        cfg.train.precision = args.precision
    target = load_target(cfg.target)
    config = target.model.config
    size = cfg.tree.draft_vocab_size
    vocab = torch.arange(size) if size else None  # the cost depends on the size, not on which ids
    frozen = FrozenTarget.from_model(target.model, torch.float32, vocab)
    length = args.length or cfg.features.max_len // 2
    aux_width = len(eagle3_layers(config.num_hidden_layers)) * config.hidden_size
    batch = batch_like(cfg, config.hidden_size, config.vocab_size, length, aux_width)
    print(f"config {args.config}: batch {cfg.train.batch_size} x {length} tokens, {args.threads} thread(s), "
          f"hca_passes {cfg.train.hca_passes}, draft vocabulary {size or config.vocab_size}, {cfg.train.precision}")
    for kind in args.kinds:
        head = new_head(config, kind=kind, draft_vocab=vocab)
        settings = LossSettings.for_kind(kind, cfg.train)
        optimizer = torch.optim.AdamW(head.parameters(), lr=1e-4)
        run_passes(head, batch, frozen, settings, backward=True)  # warm-up
        start = time.perf_counter()
        for _ in range(args.steps):
            optimizer.zero_grad()
            run_passes(head, batch, frozen, settings, backward=True)
            optimizer.step()
        seconds = (time.perf_counter() - start) / args.steps
        print(f"{kind:7s} {batch.tokens / seconds:8.0f} tokens/s ({seconds:.2f} s per step)")


if __name__ == "__main__":
    main()
