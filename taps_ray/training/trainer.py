"""Train one draft head (EAGLE-2, HASS or EAGLE-3) on the cached target features of one mixture.

AdamW (β = 0.9, 0.95), gradient clipping by value, linear warm-up then cosine decay, fp32 weights on the target's
device (`target.device`), forward passes in fp32 or under bf16 autocast (``train.precision``); stored features
stay on the CPU and each batch moves to the head. The budget is ``train.epochs`` epochs, cut short by
``train.max_tokens`` trained tokens when set; the schedule is planned for the exact number of steps that budget
gives.

Features are streamed: the split and the batch plan read only the shards' index (ids and lengths,
`FeatureSet.entries`); each epoch takes the shards in a seeded shuffled order, ``train.shuffle_shards`` at a
time, shuffles and batches the examples of those shards, and reads their features only then. Memory is a
few shards, not the corpus; an epoch's order depends only on (seed, epoch), so a resumed run replays it.
Freed windows go back to the OS (`malloc.pin_mmap_threshold`), so the peak does not creep up window by window.

Held-out split: a conversation is held out when a hash of (train.seed, its id) falls below
``train.heldout_fraction``. The rule depends only on the id, so a conversation held out of one mixture is held
out of every mixture that contains it: no head ever trains on another mixture's held-out data, which makes
the cross-domain agreement table (``agreement.py``) clean.

Checkpoints: ``heads/<kind>-<mixture>/epoch-N`` after every epoch (head weights + config.json, state.json
with the metrics history, and optimizer.pt with the optimizer and scheduler state — kept in the newest
epoch only). Each is written into a temporary folder and renamed, so a folder that exists is complete.
A restarted run resumes from the newest complete epoch when the run fingerprint (features, kind and train
settings) matches, and starts afresh otherwise. ``final`` is a copy of the last epoch's weights.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence, TypeVar

import torch
from tqdm.auto import tqdm

from taps_ray.config import StudyConfig, check_head_kind
from taps_ray.data.draft_vocab import draft_vocabulary
from taps_ray.fsio import atomic_dir, folder_lock
from taps_ray.models.draft_head import DraftHead, new_head
from taps_ray.models.draft_parts import load_training_target
from taps_ray.models.target import Target
from taps_ray.training.features import Entry, Example, FeatureSet, extract_features
from taps_ray.training.losses import Batch, FrozenTarget, LossSettings, run_passes
from taps_ray.training.malloc import pin_mmap_threshold
from taps_ray.workdir import EPOCH_GLOB, FINAL, epoch_checkpoint, head_dir

log = logging.getLogger(__name__)

STATE_FILE = "state.json"
OPTIMIZER_FILE = "optimizer.pt"
METRICS_FILE = "metrics.json"
Report = Callable[[dict], None]
Item = TypeVar("Item")  # an Example or an Entry: anything with an `.id`


def configure_threads() -> int:
    """Use the cores this process may run on (OMP_NUM_THREADS wins, e.g. inside a Ray task)."""
    wanted = os.environ.get("OMP_NUM_THREADS")
    try:
        n = int(wanted) if wanted else len(os.sched_getaffinity(0))
    except (ValueError, AttributeError):
        n = os.cpu_count() or 1
    n = max(1, n)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


# --- data ------------------------------------------------------------------------------------------------------

def is_heldout(conv_id: str, fraction: float, seed: int) -> bool:
    digest = hashlib.sha256(f"{seed}:{conv_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def split_examples(examples: Sequence[Item], fraction: float, seed: int) -> tuple[list[Item], list[Item]]:
    """(train, heldout) by the id-hash rule; at least one of each when there are two or more examples.
    Anything with an `.id` splits: training splits the `Entry` index, so it never loads held-out features."""
    train = [e for e in examples if not is_heldout(e.id, fraction, seed)]
    held = [e for e in examples if is_heldout(e.id, fraction, seed)]
    if len(examples) >= 2 and (not held or not train):
        def rank(e: Item) -> bytes:
            return hashlib.sha256(f"{seed}:{e.id}".encode()).digest()

        if not held:
            pick = min(train, key=rank)
            train, held = [e for e in train if e is not pick], [pick]
        else:
            pick = max(held, key=rank)
            train, held = [pick], [e for e in held if e is not pick]
    return train, held


def collate(examples: Sequence[Example]) -> Batch:
    lengths = torch.tensor([len(e) for e in examples])
    b, t = len(examples), int(lengths.max())
    d, k = examples[0].hidden.shape[1], examples[0].topk_probs.shape[1]
    ids = torch.zeros(b, t, dtype=torch.long)
    mask = torch.zeros(b, t)
    hidden = torch.zeros(b, t, d, dtype=examples[0].hidden.dtype)
    probs = torch.zeros(b, t, k)
    top_ids = torch.zeros(b, t, k, dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e)
        ids[i, :n], mask[i, :n], hidden[i, :n] = e.input_ids, e.loss_mask, e.hidden
        probs[i, :n], top_ids[i, :n] = e.topk_probs, e.topk_ids
    aux = None
    if examples[0].aux is not None:
        aux = torch.zeros(b, t, examples[0].aux.shape[1], dtype=examples[0].aux.dtype)
        for i, e in enumerate(examples):
            aux[i, : len(e)] = e.aux
    return Batch(ids, mask, hidden, lengths, probs, top_ids, aux)


Window = list[list[Entry]]  # the batches drawn from one window of shards: read together, then dropped


def shard_windows(entries: Sequence[Entry], shard_order: Sequence[int], window: int) -> list[list[Entry]]:
    """The entries of `window` shards at a time, shards taken in `shard_order`."""
    by_shard: dict[int, list[Entry]] = {}
    for e in entries:
        by_shard.setdefault(e.shard, []).append(e)
    order = [shard for shard in shard_order if shard in by_shard]
    return [[e for shard in order[i: i + window] for e in by_shard[shard]] for i in range(0, len(order), window)]


def epoch_batches(entries: Sequence[Entry], batch_size: int, seed: int, epoch: int, window: int) -> list[Window]:
    """One epoch, seeded: shards in shuffled order, `window` at a time; within a window a shuffle, then
    length-grouped batches (sorted within pools of 8 batches) in shuffled order."""
    rng = random.Random(f"{seed}:{epoch}")
    shard_order = sorted({e.shard for e in entries})
    rng.shuffle(shard_order)
    pool = batch_size * 8
    windows = []
    for members in shard_windows(entries, shard_order, window):
        rng.shuffle(members)
        batches = []
        for start in range(0, len(members), pool):
            chunk = sorted(members[start: start + pool], key=len)
            batches.extend(chunk[i: i + batch_size] for i in range(0, len(chunk), batch_size))
        rng.shuffle(batches)
        windows.append(batches)
    return windows


def heldout_batches(entries: Sequence[Entry], batch_size: int, window: int) -> list[Window]:
    """Held-out evaluation: shards in stored order, `window` at a time, each window's examples by length."""
    windows = []
    for members in shard_windows(entries, sorted({e.shard for e in entries}), window):
        ordered = sorted(members, key=len)
        windows.append([ordered[i: i + batch_size] for i in range(0, len(ordered), batch_size)])
    return windows


def stream_batches(features: FeatureSet, windows: Sequence[Window], steps: int | None = None) -> Iterator[Batch]:
    """The first `steps` (default: all) batches of `windows`, collated; only one window's shards are in memory."""
    for window in windows:
        batches = window if steps is None else window[: max(0, steps)]
        if not batches:
            return
        if steps is not None:
            steps -= len(batches)
        wanted = [e for batch in batches for e in batch]
        examples = features.read({e.shard for e in wanted}, {e.id for e in wanted})
        for batch in batches:
            yield collate([examples[e.id] for e in batch])
        del examples  # before the next window is read


@dataclass
class Plan:
    epochs: int
    steps: int
    steps_per_epoch: list[int]


def plan_budget(entries: Sequence[Entry], cfg: StudyConfig) -> Plan:
    """Exact number of optimizer steps of the budget: train.epochs, stopped early at train.max_tokens."""
    t = cfg.train
    tokens, per_epoch = 0, []
    for epoch in range(1, t.epochs + 1):
        steps = 0
        for batch in (b for window in epoch_batches(entries, t.batch_size, t.seed, epoch, t.shuffle_shards) for b in window):
            steps += 1
            tokens += sum(len(e) for e in batch)
            if t.max_tokens is not None and tokens >= t.max_tokens:
                break
        per_epoch.append(steps)
        if t.max_tokens is not None and tokens >= t.max_tokens:
            break
    return Plan(epochs=len(per_epoch), steps=sum(per_epoch), steps_per_epoch=per_epoch)


def lr_lambda(total_steps: int, warmup_ratio: float, min_ratio: float) -> Callable[[int], float]:
    warmup = max(1, round(warmup_ratio * total_steps)) if warmup_ratio > 0 else 0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


# --- evaluation ------------------------------------------------------------------------------------------------

@torch.no_grad()
def evaluate(head: DraftHead, batches: Iterable[Batch], frozen: FrozenTarget, settings: LossSettings,
             passes: int | None = None) -> dict[str, float]:
    """Mask-weighted held-out loss (pass 0) and top-1 agreement with the target (acc_j: simulated depth j+1)."""
    was_training = head.training
    head.eval()
    sums: dict[str, float] = {}
    weight = 0.0
    tokens = 0
    for batch in batches:
        result = run_passes(head, batch, frozen, settings, backward=False, noise=False, passes=passes)
        w = result.mask_tokens
        for name, value in result.terms.items():
            sums[name] = sums.get(name, 0.0) + value * w
        weight += w
        tokens += batch.tokens
    head.train(was_training)
    out = {name: value / max(weight, 1e-9) for name, value in sums.items()}
    out["scored_tokens"] = weight
    out["tokens"] = tokens
    return out


# --- checkpoints -----------------------------------------------------------------------------------------------

def run_fingerprint(cfg: StudyConfig, kind: str, features: FeatureSet) -> str:
    train = cfg.train.model_dump(exclude={"kinds", "mixtures", "ttt_steps", "ttt_outside_vocab"})
    steps = LossSettings.for_kind(kind, cfg.train, cfg.tree.depth).passes
    if kind == "eagle3" and steps != cfg.train.hca_passes:
        # Only EAGLE-3 heads unroll a training-time test; one of hca_passes steps is what heads trained before
        # ttt_steps existed ran, so they keep their fingerprints (and the other kinds always do).
        train["ttt_steps"] = steps
    if kind == "eagle3" and cfg.train.ttt_outside_vocab != "keep":  # likewise: heads that keep them keep their key
        train["ttt_outside_vocab"] = cfg.train.ttt_outside_vocab
    data = {"kind": kind, "features": features.key, "train": train, "draft_vocab_size": cfg.tree.draft_vocab_size}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def save_epoch(folder: Path, epoch: int, head: DraftHead, optimizer, scheduler, state: dict) -> Path:
    target = epoch_checkpoint(folder, epoch)
    with atomic_dir(target) as staging:
        head.save(staging)
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, staging / OPTIMIZER_FILE)
        (staging / STATE_FILE).write_text(json.dumps(state, indent=2))
    for older in folder.glob(EPOCH_GLOB):  # optimizer state only in the newest epoch
        if older != target and (older / OPTIMIZER_FILE).exists():
            (older / OPTIMIZER_FILE).unlink()
    return target


def write_final(folder: Path, epoch_dir: Path, state: dict) -> Path:
    final = folder / FINAL
    with atomic_dir(final) as staging:
        for name in ("model.safetensors", "config.json"):
            shutil.copy2(epoch_dir / name, staging / name)
        (staging / METRICS_FILE).write_text(json.dumps(state, indent=2))
    return final


def latest_checkpoint(folder: Path, fingerprint: str) -> tuple[Path, dict] | None:
    """The newest complete epoch of this run, or None. Checkpoints of another run are removed."""
    found = []
    for path in folder.glob(EPOCH_GLOB):
        try:
            state = json.loads((path / STATE_FILE).read_text())
        except (OSError, ValueError):
            continue
        found.append((state.get("epoch", -1), path, state))
    stale = [p for _, p, s in found if s.get("fingerprint") != fingerprint]
    if stale:
        log.warning("%s holds checkpoints of other settings; starting afresh", folder)
        for path in [*stale, folder / FINAL]:
            shutil.rmtree(path, ignore_errors=True)
    usable = sorted((e, p, s) for e, p, s in found if s.get("fingerprint") == fingerprint and (p / OPTIMIZER_FILE).is_file())
    if not usable:
        return None
    _, path, state = usable[-1]
    return path, state


# --- training --------------------------------------------------------------------------------------------------

def train_head(cfg: StudyConfig, kind: str, mixture_name: str, report: Report | None = None, *,
               target: Target | None = None, progress: bool = True, stop_after_epochs: int | None = None) -> Path:
    """Train (or resume, or reuse) the `kind` head on `mixture_name`; returns the ``final`` checkpoint folder.

    ``report(metrics)`` is called after every epoch's checkpoint is written. ``stop_after_epochs`` ends the
    run early after that many epochs of this call, as a kill would (for tests); no ``final`` is written then.
    """
    check_head_kind(kind)
    if kind not in cfg.train.kinds:  # the feature key depends on the kinds (eagle3 keeps extra layers)
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"kinds": [*cfg.train.kinds, kind]})})
    folder = head_dir(cfg, kind, mixture_name)
    with folder_lock(folder):  # a second process training the same head waits, then reuses it
        return _train_head(cfg, kind, mixture_name, report, target, progress, stop_after_epochs)


@dataclass
class _Run:
    """What one head's training works with, set up once (`_set_up`): its data, the frozen target, the head, its
    optimizer and schedule, and the run state that every checkpoint saves (`state.json`)."""

    cfg: StudyConfig
    kind: str
    mixture: str
    folder: Path
    features: FeatureSet
    device: torch.device
    train_ex: list[Entry]
    held_ex: list[Entry]
    frozen: FrozenTarget
    settings: LossSettings
    eval_passes: int
    plan: Plan
    fingerprint: str
    head: DraftHead
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    state: dict


@dataclass
class _EpochTotals:
    """One epoch's training sums: loss terms weighted by their masked tokens, tokens trained, wall and CPU time."""

    sums: dict[str, float]
    weight: float
    tokens: int
    seconds: float
    cpu_seconds: float


def _set_up(cfg: StudyConfig, kind: str, mixture_name: str, target: Target | None, progress: bool) -> _Run:
    """Threads, features, the split, the draft vocabulary, the frozen target, a fresh head, its optimizer and
    schedule, and the state of a run that has trained nothing yet."""
    threads = configure_threads()
    pin_mmap_threshold()  # freed feature windows go back to the OS: the peak stays flat in corpus size
    t = cfg.train
    # the whole target only while features are missing (extract_features loads it then); training itself
    # reads the embeddings and LM head alone, so a trial on cached features never holds the decoder layers
    features = extract_features(cfg, mixture_name, target=target, progress=progress)
    if target is None:
        target = load_training_target(cfg.target)
    train_ex, held_ex = split_examples(features.entries(), t.heldout_fraction, t.seed)
    if not train_ex:
        raise ValueError(f"mixture {mixture_name!r} has no usable training conversations")
    vocab = draft_vocabulary(cfg, target.tokenizer, target.stop_token_ids)
    frozen = FrozenTarget.from_model(target.model, torch.float32, vocab)
    settings = LossSettings.for_kind(kind, t, cfg.tree.depth, target.device)
    plan = plan_budget(train_ex, cfg)
    folder = head_dir(cfg, kind, mixture_name)
    folder.mkdir(parents=True, exist_ok=True)
    for leftover in folder.glob(".*.tmp-*"):  # staging folders of a killed run
        shutil.rmtree(leftover, ignore_errors=True)
    fingerprint = run_fingerprint(cfg, kind, features)

    head = new_head(target.model.config, torch.float32, seed=t.seed, draft_vocab=vocab, device=target.device,
                    kind=kind, target=cfg.target.name, trained_on=mixture_name)
    if head.eagle3:  # EAGLE-3's own LM head starts as the target's, restricted to the draft vocabulary
        head.lm_head.weight.data.copy_(frozen.lm_head)
    optimizer = torch.optim.AdamW(head.parameters(), lr=t.lr, betas=(0.9, 0.95), weight_decay=t.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(plan.steps, t.warmup_ratio, t.min_lr_ratio))
    state: dict = {
        "fingerprint": fingerprint, "kind": kind, "mixture": mixture_name, "features": features.key,
        "epoch": 0, "step": 0, "tokens": 0, "train_seconds": 0.0, "planned_epochs": plan.epochs,
        "planned_steps": plan.steps, "train_conversations": len(train_ex), "heldout_conversations": len(held_ex),
        "epoch_size_tokens": sum(len(e) for e in train_ex),
        "feature_stats": {k: v for k, v in features.stats.items() if k != "reused"}, "history": [],
        "threads": threads, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
    }
    return _Run(cfg, kind, mixture_name, folder, features, target.device, train_ex, held_ex, frozen, settings,
                max(1, t.hca_passes), plan, fingerprint, head, optimizer, scheduler, state)


def _resume(run: _Run) -> None:
    """Continue from the newest complete epoch of a run with the same fingerprint, if there is one: its head
    weights, optimizer and schedule, and its state."""
    resumed = latest_checkpoint(run.folder, run.fingerprint)
    if resumed is None:
        return
    path, saved = resumed
    run.head.load_trainable(DraftHead.load(path).trainable_state())
    opt = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=False)  # loading moves it to the head
    run.optimizer.load_state_dict(opt["optimizer"])
    run.scheduler.load_state_dict(opt["scheduler"])
    run.state = saved
    log.info("%s: resuming after epoch %d", run.folder.name, run.state["epoch"])


def _finished(run: _Run) -> Path:
    """The `final` checkpoint of a run that has trained every planned epoch, written when missing or stale."""
    final = run.folder / FINAL
    if not (final / "model.safetensors").is_file() or json.loads((final / METRICS_FILE).read_text()).get(
            "fingerprint") != run.fingerprint:
        final = write_final(run.folder, epoch_checkpoint(run.folder, run.state['epoch']), run.state)
    return final


def _train_epoch(run: _Run, epoch: int, bar: tqdm) -> _EpochTotals:
    """One epoch of optimizer steps over the epoch's seeded batch order (so a resumed run replays it)."""
    t = run.cfg.train
    generator = torch.Generator(device=run.device).manual_seed(t.seed * 100003 + epoch)
    windows = epoch_batches(run.train_ex, t.batch_size, t.seed, epoch, t.shuffle_shards)
    sums: dict[str, float] = {}
    weight, epoch_tokens, start, cpu_start = 0.0, 0, time.perf_counter(), time.process_time()
    for batch in stream_batches(run.features, windows, run.plan.steps_per_epoch[epoch - 1]):
        run.optimizer.zero_grad(set_to_none=True)
        result = run_passes(run.head, batch, run.frozen, run.settings, backward=True, generator=generator)
        torch.nn.utils.clip_grad_value_(run.head.parameters(), t.grad_clip_value)
        run.optimizer.step()
        run.scheduler.step()
        for name, value in result.terms.items():
            sums[name] = sums.get(name, 0.0) + value * result.mask_tokens
        weight += result.mask_tokens
        epoch_tokens += batch.tokens
        run.state["step"] += 1
        elapsed = time.perf_counter() - start
        bar.update(1)
        bar.set_postfix(loss=f"{result.terms['loss0']:.3f}", acc=f"{result.terms['acc']:.3f}",
                        tok_s=f"{epoch_tokens / max(elapsed, 1e-9):.0f}")
    return _EpochTotals(sums, weight, epoch_tokens, time.perf_counter() - start, time.process_time() - cpu_start)


def _epoch_metrics(run: _Run, epoch: int, totals: _EpochTotals) -> dict:
    """Count the epoch into the run state, evaluate on the held-out split and return the epoch's metrics row."""
    t, state = run.cfg.train, run.state
    seconds, cpu_seconds, epoch_tokens, weight = totals.seconds, totals.cpu_seconds, totals.tokens, totals.weight
    state["tokens"] += epoch_tokens
    state["train_seconds"] += seconds
    state["train_cpu_seconds"] = state.get("train_cpu_seconds", 0.0) + cpu_seconds
    eval_start = time.perf_counter()
    held_batches = stream_batches(run.features, heldout_batches(run.held_ex, t.eval_batch_size, t.shuffle_shards))
    held = evaluate(run.head, held_batches, run.frozen, run.settings, passes=run.eval_passes) if run.held_ex else {}
    return {
        "epoch": epoch,
        "step": state["step"],
        "tokens": state["tokens"],
        "epoch_tokens": epoch_tokens,
        "epoch_seconds": round(seconds, 3),
        "tokens_per_s": round(epoch_tokens / max(seconds, 1e-9), 1),
        "epoch_cpu_seconds": round(cpu_seconds, 3),
        "tokens_per_cpu_s": round(epoch_tokens / max(cpu_seconds, 1e-9), 1),
        "lr": run.scheduler.get_last_lr()[0],
        "train_loss": totals.sums.get("loss0", 0.0) / max(weight, 1e-9),
        "train_acc": totals.sums.get("acc", 0.0) / max(weight, 1e-9),
        # the EAGLE loss (regression + soft CE), comparable across head kinds; HASS adds its top-K term
        "heldout_loss": (t.reg_weight * held.get("reg", 0.0) + t.cls_weight * held["cls"]) if held else None,
        "heldout_topk": held.get("topk"),
        "heldout_acc": held.get("acc"),
        **{f"heldout_acc_{j}": held.get(f"acc_{j}") for j in range(run.eval_passes)},
        "heldout_tokens": held.get("scored_tokens"),
        "eval_seconds": round(time.perf_counter() - eval_start, 3),
        "load_average": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def _train_head(cfg: StudyConfig, kind: str, mixture_name: str, report: Report | None, target: Target | None,
                progress: bool, stop_after_epochs: int | None) -> Path:
    """Set up, resume, train the remaining epochs (a checkpoint and a metrics row each), then write `final`."""
    run = _set_up(cfg, kind, mixture_name, target, progress)
    _resume(run)
    if run.state["epoch"] >= run.plan.epochs:
        return _finished(run)

    run.head.train()
    bar = tqdm(total=run.plan.steps, initial=run.state["step"], desc=f"train {kind}-{mixture_name}", unit="step",
               disable=not progress)
    epochs_this_call = 0
    last_dir = None
    try:
        for epoch in range(run.state["epoch"] + 1, run.plan.epochs + 1):
            metrics = _epoch_metrics(run, epoch, _train_epoch(run, epoch, bar))
            run.state["epoch"] = epoch
            run.state["history"].append(metrics)
            last_dir = save_epoch(run.folder, epoch, run.head, run.optimizer, run.scheduler, run.state)
            log.info("%s epoch %d: %s", run.folder.name, epoch, json.dumps(metrics))
            if report is not None:
                report({**metrics, "kind": kind, "mixture": mixture_name, "checkpoint": str(last_dir)})
            epochs_this_call += 1
            if stop_after_epochs is not None and epochs_this_call >= stop_after_epochs and epoch < run.plan.epochs:
                return last_dir
    finally:
        bar.close()
    assert last_dir is not None
    return write_final(run.folder, last_dir, run.state)


def load_final_metrics(head_path: str | Path) -> dict:
    """A finished head's training record (`metrics.json`), {} when the head has none."""
    path = Path(head_path) / METRICS_FILE
    return json.loads(path.read_text()) if path.is_file() else {}
