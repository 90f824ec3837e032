#!/usr/bin/env python
"""Cost of regenerating target answers (`answers: target`) for a config's mixtures, from a small sample. Not a test.

    python benchmarks/training/answers_cost.py --config configs/cpu.yaml --sample 16

Regenerates the first `--sample` conversations of each target-answer mixture the config trains on, as feature
extraction does (batches of features.batch_size, every user turn in order, features.regenerate_max_new_tokens
per turn), and extrapolates wall and CPU time to the mixture's size. CPU time (all threads) is the figure to
trust on a shared machine; the load average is printed with it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from taps_ray.config import load_config  # noqa: E402
from taps_ray.data.mixtures import build_mixture  # noqa: E402
from taps_ray.models.target import load_target  # noqa: E402
from taps_ray.training.answers import regenerate_answers  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--sample", type=int, default=16, help="conversations timed per mixture")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    cfg = load_config(args.config)
    torch.set_num_threads(args.threads)
    target = load_target(cfg.target)
    f = cfg.features
    print(f"{cfg.name}: {f.regenerate_max_new_tokens} new tokens per turn, max_len {f.max_len}, batch {f.batch_size}, "
          f"{args.threads} threads, {cfg.target.dtype}")
    for name in cfg.head_mixtures():
        mixture = cfg.mixtures[name]
        if mixture.answers != "target":
            continue
        convs = build_mixture(mixture, cfg.resolved_data_dir())[: args.sample]
        users = sum(m["role"] == "user" for c in convs for m in c.messages)
        wall, cpu = time.perf_counter(), time.process_time()
        out = regenerate_answers(target, convs, f.batch_size, f.regenerate_max_new_tokens, f.max_len)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        answered = sum(m["role"] == "assistant" for c in out for m in c.messages)
        scale = mixture.size / len(convs)
        print(f"{name}: {len(convs)} conversations, {users} user turns -> {len(out)} kept, {answered} answered turns; "
              f"{wall:.1f} s wall, {cpu:.1f} CPU-s; for all {mixture.size}: {wall * scale / 60:.1f} min wall, "
              f"{cpu * scale / 60:.1f} CPU-min (mixtures sharing conversations copy them instead)")
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
