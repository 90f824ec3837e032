"""The mixture search on Ray Tune (`taps search`): which math/chat ratio (and size) trains the best head?

Each trial draws a mathinstruct share from the `search.math_ratio` range (on the `search.ratio_step` grid; sharegpt
gets the rest) and a size from `search.sizes`, trains one `search.kind` head on that mixture with the study's
training settings (`search.max_epochs` / `search.max_tokens` override its budget) and, after every epoch, reports
the head's held-out top-1 agreement with the target on each `search.heldout` mixture and their mean,
`agreement`. ASHA (`search.grace_period`, `search.reduction_factor`, max_t = the trial's epochs) stops the trials
that trail at a rung. The trial with the best last `agreement` becomes the `searched` head
(`workdir.searched_head`), which the study then evaluates as one more proposer (`drafting.setup.with_searched`).

Cost: a trial's mixture is a seeded sample of each corpus with `search.seed`, the held-out mixtures' seed by
default, so its conversations are the heads of the samples the held-out mixtures drew and their features are
copied from those sets (`training.features`), not recomputed, as long as the trial asks for no more
conversations of a corpus than they hold. The held-out rule is the study's (by conversation id), so no trial
trains on a conversation that scores it.

Resuming, as in the training stage (`study.tune`): the experiment's name digests the search and training
settings and the held-out feature sets, so a rerun finds it and restores it with `Tuner.restore` (finished
trials stay finished, the others restart), and a restarted trial continues from its head's newest epoch
checkpoint. A trial whose mixture an earlier search already trained reports that head instead of retraining it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from taps_ray.config import ConfigError, MixtureConfig, StudyConfig, TrainConfig, parse_config
from taps_ray.models.target import load_target
from taps_ray.ray_runtime import start_ray
from taps_ray.study.run_config import absolute_paths, log_line, quick_config, remote_env
from taps_ray.study.tune import numeric_metrics, open_experiment, restore_checkpoint
from taps_ray.training.agreement import evaluate_agreement
from taps_ray.training.features import extract_features, features_key
from taps_ray.training.trainer import METRICS_FILE, STATE_FILE, train_head, write_final
from taps_ray.workdir import search_trial_mixture, searched_head

EXPERIMENT_PREFIX = "search"
METRIC = "agreement"  # the mean over search.heldout of the head's held-out top-1 agreement, what ASHA compares
RATIO, SIZE = "math_ratio", "size"  # the sampled parameters


def ratio_grid(cfg: StudyConfig) -> list[float]:
    """The mathinstruct shares a trial may draw: `search.math_ratio` on the `search.ratio_step` grid, both ends in."""
    low, high = cfg.search.math_ratio
    steps = int((high - low) / cfg.search.ratio_step + 1e-9)
    return sorted({round(low + i * cfg.search.ratio_step, 6) for i in range(steps + 1)} | {round(high, 6)})


def search_sizes(cfg: StudyConfig) -> list[int]:
    """`search.sizes`, or the smallest held-out mixture's size: its features then hold every trial's conversations."""
    return cfg.search.sizes or [min(cfg.mixtures[name].size for name in cfg.search.heldout)]


def trial_budget(cfg: StudyConfig) -> TrainConfig:
    """The study's training settings with the search's budget, `search.kind` among the kinds (an eagle3 search
    keeps the extra target layers in every feature set it reads, the held-out ones included)."""
    s, t = cfg.search, cfg.train
    return t.model_copy(update={"epochs": s.max_epochs or t.epochs, "kinds": list(dict.fromkeys([*t.kinds, s.kind])),
                                "max_tokens": s.max_tokens if s.max_tokens is not None else t.max_tokens})


def trial_config(cfg: StudyConfig, ratio: float, size: int) -> tuple[StudyConfig, str]:
    """The study with the trial's mixture added (and the search's budget), and that mixture's name."""
    shares = {"mathinstruct": ratio, "sharegpt": 1 - ratio}
    mixture = MixtureConfig(mixture={c: r for c, r in shares.items() if r > 0}, size=size, seed=cfg.search.seed)
    name = search_trial_mixture(ratio, size)
    return cfg.model_copy(update={"mixtures": {**cfg.mixtures, name: mixture}, "train": trial_budget(cfg)}), name


def heldout_agreement(cfg: StudyConfig, head: str | Path, target: Any) -> dict[str, float]:
    """{"agreement_<mixture>": depth-1 held-out agreement for each search.heldout mixture, METRIC: their mean}."""
    measured = evaluate_agreement(cfg, head, cfg.search.heldout, target=target, passes=1)
    scores = {f"{METRIC}_{name}": float(measured[name]["acc"]) for name in cfg.search.heldout}
    return {**scores, METRIC: sum(scores.values()) / len(scores)}


def _trial(config: dict, study: str = "", env: dict | None = None) -> None:
    """One trial: train (or resume) the sampled mixture's head, reporting its held-out agreement every epoch."""
    from ray import tune

    os.environ.update(env or {})
    cfg, mixture = trial_config(parse_config(json.loads(study), "<search trial>"), config[RATIO], config[SIZE])
    kind = cfg.search.kind
    target = load_target(cfg.target)
    for name in cfg.search.heldout:  # first: the trial's set copies their conversations
        extract_features(cfg, name, target=target, progress=False)
    checkpoint = tune.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            restore_checkpoint(cfg, kind, mixture, Path(folder))
    reported: list[int] = []

    def report(metrics: dict, folder: str) -> None:
        reported.append(metrics["epoch"])
        scores = heldout_agreement(cfg, folder, target)
        tune.report({**numeric_metrics(metrics), **scores}, checkpoint=tune.Checkpoint.from_directory(folder))

    final = train_head(cfg, kind, mixture, report=lambda m: report(m, m["checkpoint"]), target=target, progress=False)
    if not reported:  # trained by an earlier search: report its finished head once
        report(json.loads((final / METRICS_FILE).read_text())["history"][-1], str(final))


def search_space(cfg: StudyConfig) -> dict:
    from ray import tune

    return {RATIO: tune.choice(ratio_grid(cfg)), SIZE: tune.choice(search_sizes(cfg))}


def experiment_name(cfg: StudyConfig) -> str:
    """The search's experiment: config name, head kind and a digest of everything a trial's result depends on."""
    spec = {"search": cfg.search.model_dump(mode="json"), "sizes": search_sizes(cfg),
            "train": trial_budget(cfg).model_dump(mode="json"), "vocab": cfg.tree.draft_vocab_size,
            "heldout": [features_key(cfg, name) for name in cfg.search.heldout]}
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
    label = re.sub(r"[^A-Za-z0-9_.+-]", "_", f"{cfg.name}-{cfg.search.kind}")
    return f"{EXPERIMENT_PREFIX}-{label}-{digest}"


def _trial_name(trial) -> str:
    return f"m{trial.config[RATIO]:g}-n{trial.config[SIZE]}-{trial.trial_id}"


def save_searched(cfg: StudyConfig, best: Any, experiment: str) -> Path:
    """Write the best trial's newest checkpoint as the `searched` head, with what the search found in its
    metrics.json; an unchanged pick leaves the head (and its agreement caches) as it is."""
    found = {"experiment": experiment, "trial": best.metrics.get("trial_id"), RATIO: best.config[RATIO],
             SIZE: best.config[SIZE], "epoch": best.metrics.get("epoch"),
             **{k: v for k, v in best.metrics.items() if k.startswith(METRIC)}}
    final = searched_head(cfg, cfg.search.kind)
    try:
        if json.loads((final / METRICS_FILE).read_text()).get("search") == found:
            return final
    except (OSError, ValueError):
        pass
    with best.checkpoint.as_directory() as folder:
        folder = Path(folder)
        record = folder / STATE_FILE if (folder / STATE_FILE).is_file() else folder / METRICS_FILE
        return write_final(final.parent, folder, {**json.loads(record.read_text()), "search": found})


def run_search(cfg: StudyConfig, env: dict[str, str] | None = None,
               log_line: Callable[[str], None] = print) -> dict[str, Any]:
    """Run (or restore) the mixture search and save its best head; returns the trials and the pick."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search.basic_variant import BasicVariantGenerator

    s = cfg.search
    unknown = [name for name in s.heldout if name not in cfg.mixtures]
    if unknown:
        raise ConfigError(f"search.heldout names {unknown} but mixtures defines only {sorted(cfg.mixtures)}")
    start = time.perf_counter()
    epochs = trial_budget(cfg).epochs
    tune_config = tune.TuneConfig(
        metric=METRIC, mode="max", num_samples=s.num_samples,
        scheduler=ASHAScheduler(time_attr="epoch", max_t=epochs, grace_period=min(s.grace_period, epochs),
                                reduction_factor=s.reduction_factor),
        search_alg=BasicVariantGenerator(random_state=s.seed),
        max_concurrent_trials=s.max_concurrent_trials, trial_name_creator=_trial_name,
        trial_dirname_creator=_trial_name,
    )
    trainable = tune.with_parameters(_trial, study=cfg.model_dump_json(), env=env or {})
    tuner, path, restored = open_experiment(cfg, experiment_name(cfg), trainable, search_space(cfg), tune_config)
    log_line(f"search: {'restoring' if restored else 'starting'} {s.num_samples} trials over mathinstruct shares "
             f"{ratio_grid(cfg)}, sizes {search_sizes(cfg)} ({s.kind} heads, up to {epochs} epochs) -> {path}")
    results = tuner.fit()
    trials = sorted((_trial_summary(result) for result in results), key=lambda t: t["trial"])
    for trial in trials:
        log_line(f"search: {trial}")
    scored = [r for r in results if r.error is None and METRIC in (r.metrics or {})]
    summary: dict[str, Any] = {"experiment": path, "restored_experiment": restored, "trials": trials,
                               "failed": sum(1 for t in trials if t["error"]), "best": None}
    if scored:
        in_order = sorted(scored, key=lambda r: r.metrics["trial_id"])
        best = max(in_order, key=lambda r: r.metrics[METRIC])  # a tie goes to the first trial
        head = save_searched(cfg, best, Path(path).name)
        summary["best"] = json.loads((head / METRICS_FILE).read_text())["search"]
        log_line(f"search: best mathinstruct share {best.config[RATIO]:g}, size {best.config[SIZE]}: held-out "
                 f"{METRIC} {best.metrics[METRIC]:.3f} -> {head} (proposer `searched`)")
    summary["seconds"] = round(time.perf_counter() - start, 1)
    return summary


def _trial_summary(result: Any) -> dict[str, Any]:
    metrics = result.metrics or {}
    return {"trial": metrics.get("trial_id", ""), RATIO: result.config[RATIO], SIZE: result.config[SIZE],
            "epochs": metrics.get("epoch"),
            **{k: round(v, 4) for k, v in metrics.items() if k.startswith(METRIC)},
            "error": None if result.error is None else str(result.error)[:300]}


def quick_search(cfg: StudyConfig) -> StudyConfig:
    """The sweep's `--quick` study (few conversations, small budgets, its own work dir) with at most 4 trials of
    at most 2 epochs: a search that finishes in minutes."""
    quick = quick_config(cfg)
    search = quick.search.model_copy(update={"num_samples": min(cfg.search.num_samples, 4), "sizes": [],
                                             "max_epochs": min(cfg.search.max_epochs or 2, 2)})
    return quick.model_copy(update={"search": search})


def cmd_search(cfg: StudyConfig, quick: bool = False) -> int:
    """`taps search [--quick]`: on a local Ray (or the configured cluster), like the sweep."""
    cfg = absolute_paths(quick_search(cfg) if quick else cfg)
    start_ray(cfg.ray)
    summary = run_search(cfg, remote_env(cfg), log_line)
    return 0 if summary["best"] is not None and not summary["failed"] else 1
