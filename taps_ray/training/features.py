"""Extract and cache the frozen target's features for a training mixture (docs/algorithms.md#feature-extraction).

Per conversation we store: ``input_ids`` [L], ``loss_mask`` [L] (assistant content + closing end-of-turn),
``hidden`` [L, d] = ``hidden_states[-1]`` (after the final norm, the vector the LM head reads), and the target's
top-K next-token probabilities and token ids [L, K] (for the HASS top-K loss).
When the study trains EAGLE-3 heads, also ``aux`` [L, 3d]: the hidden states of EAGLE-3's low, mid and high
target layers (`draft_head.eagle3_layers`), concatenated; other studies store no extra layer.

Half precision on disk and in memory (the features are most of a study's disk and of training's memory):
``hidden`` in bfloat16 — the exponent range of fp32, so no target activation overflows, and lossless for a
bf16 target, the paper setting — and the top-K probabilities in float16, which keeps three more mantissa
bits than bf16 for values that all lie in [0, 1]. Training casts each batch to its own dtype.

The target runs on right-padded batches whose attention mask is built from the sequence lengths (never from
``ids != pad``, docs/algorithms.md#feature-extraction). Conversations are cut into shards of ``features.shard_size``, each written atomically
(`taps_ray.fsio`) as one safetensors file, so a killed run redoes only the missing shards.
``manifest.json``, also written atomically, marks the whole set complete; a later call with the same key reuses it.
The three steps, `plan_shards`, `extract_shards` and `write_manifest`, run in one process here; the sweep runs the
middle one as parallel Ray tasks (`taps_ray.study.target_tasks`).

The cache key hashes everything that changes the stored tensors: the target (name, tiny settings, dtype),
the mixture (corpora and ratios, size, seed), max_len, top_k, whose answers it trains on (the corpora's, or the
target's with its generation settings, `taps_ray.training.answers`) and which extra layers are kept.
A conversation already extracted for another mixture under the same settings (same id and same messages) is
copied from that set instead of being run through the target again. The driver writes the shards that need no
target at all (every conversation copied, or too short to train on) itself, before any Ray task starts, and a
process loads the target only for a shard with something to compute: a mixed set of the paper's mixtures, made of
its donors' conversations, costs no GPU task and no load of the target.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from taps_ray.config import StudyConfig
from taps_ray.data.chat import tokenize_conversation
from taps_ray.data.mixtures import build_mixture
from taps_ray.fsio import atomic_path, atomic_write_json, folder_lock
from taps_ray.models.draft_head import eagle3_layers
from taps_ray.models.target import Target, load_target, load_tokenizer, with_pad_token
from taps_ray.training.answers import AnswerCache, length_batches, regenerate_answers
from taps_ray.workdir import features_dir

log = logging.getLogger(__name__)

FORMAT_VERSION = 3  # 3: hidden in bfloat16, top-K probabilities in float16
HIDDEN_DTYPE = torch.bfloat16
PROBS_DTYPE = torch.float16
MANIFEST = "manifest.json"


@dataclass
class Example:
    """The stored features of one conversation."""

    id: str
    input_ids: torch.Tensor  # [L] long
    loss_mask: torch.Tensor  # [L] float32
    hidden: torch.Tensor  # [L, d] HIDDEN_DTYPE
    topk_probs: torch.Tensor | None  # [L, K] PROBS_DTYPE; None in Serve's traffic buffer (its trainer fills them)
    topk_ids: torch.Tensor | None  # [L, K] long
    aux: torch.Tensor | None = None  # [L, 3d] target dtype: EAGLE-3's fused layers, when the study keeps them

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(frozen=True)
class Entry:
    """One stored conversation without its tensors: all that splitting and batch planning read."""

    id: str
    length: int
    shard: int  # index into `FeatureSet.shard_paths()`

    def __len__(self) -> int:
        return self.length


@dataclass
class FeatureSet:
    folder: Path
    manifest: dict[str, Any]
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return self.manifest["key"]

    @property
    def ids(self) -> list[str]:
        return [i for shard in self.manifest["shards"] for i in shard["ids"]]

    def shard_paths(self) -> list[Path]:
        return [self.folder / shard["file"] for shard in self.manifest["shards"]]

    def entries(self) -> list[Entry]:
        """Every conversation's id, length and shard, read from the shards' offsets alone (no features)."""
        out = []
        for index, path in enumerate(self.shard_paths()):
            with safe_open(str(path), "pt") as f:
                ids = json.loads(f.metadata()["ids"])
                lengths = f.get_tensor("offsets").diff().tolist()
            out.extend(Entry(conv_id, n, index) for conv_id, n in zip(ids, lengths))
        return out

    def read(self, shards: Iterable[int], ids: set[str]) -> dict[str, Example]:
        """The examples `ids` of these shards, by id: what training holds in memory at once."""
        paths = self.shard_paths()
        return {ex.id: ex for index in sorted(shards) for ex in read_shard(paths[index]) if ex.id in ids}

    def load(self) -> list[Example]:
        """Every example at once: for small sets (tests, inspection); training streams with `read`."""
        return [ex for path in self.shard_paths() for ex in read_shard(path)]


# --- keys and paths --------------------------------------------------------------------------------------------

def keeps_eagle3_layers(cfg: StudyConfig) -> bool:
    """The extra target layers cost disk and extraction time: they are kept only when an eagle3 head trains."""
    return "eagle3" in cfg.train.kinds


def feature_spec(cfg: StudyConfig, mixture_name: str) -> dict[str, Any]:
    if mixture_name not in cfg.mixtures:
        raise KeyError(f"mixture {mixture_name!r} is not defined in config {cfg.name!r}; known: {sorted(cfg.mixtures)}")
    f, mixture = cfg.features, cfg.mixtures[mixture_name]
    spec: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "target": cfg.target.name,
        "tiny": cfg.target.tiny.model_dump() if cfg.target.tiny is not None else None,
        "dtype": cfg.target.dtype,
        "mixture": mixture.model_dump(exclude={"answers"}),  # the answers are `regenerate`
        "max_len": f.max_len,
        "top_k": f.top_k,
        # every turn since multi-turn regeneration; donors (`_Donors`) match it, so answers never mix across sets
        "regenerate": {"max_new_tokens": f.regenerate_max_new_tokens, "turns": "all"}
        if mixture.answers == "target" else None,
    }
    if keeps_eagle3_layers(cfg):  # absent otherwise, so the keys of studies without eagle3 heads stay unchanged
        spec["aux_layers"] = "eagle3"
    return spec


def features_key(cfg: StudyConfig, mixture_name: str) -> str:
    spec = feature_spec(cfg, mixture_name)
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    return f"{mixture_name}-{digest}"


def features_folder(cfg: StudyConfig, mixture_name: str) -> Path:
    return features_dir(cfg, features_key(cfg, mixture_name))


# --- shards ----------------------------------------------------------------------------------------------------

def write_shard(path: Path, examples: Sequence[Example], meta: dict[str, Any]) -> None:
    lengths = [len(ex) for ex in examples]
    offsets = torch.tensor([0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()], dtype=torch.long)
    tensors = {
        "offsets": offsets,
        "input_ids": torch.cat([ex.input_ids for ex in examples]).to(torch.int32),
        "loss_mask": torch.cat([ex.loss_mask for ex in examples]).to(torch.uint8),
        "hidden": torch.cat([ex.hidden for ex in examples]).to(HIDDEN_DTYPE).contiguous(),
    }
    if examples and examples[0].topk_probs is not None:
        tensors["topk_probs"] = torch.cat([ex.topk_probs for ex in examples]).to(PROBS_DTYPE)
        tensors["topk_ids"] = torch.cat([ex.topk_ids for ex in examples]).to(torch.int32)
    if examples and examples[0].aux is not None:
        tensors["aux"] = torch.cat([ex.aux for ex in examples]).contiguous()
    metadata = {"ids": json.dumps([ex.id for ex in examples]), "meta": json.dumps(meta)}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)


def read_shard_meta(path: Path) -> tuple[list[str], dict[str, Any]]:
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    return json.loads(metadata["ids"]), json.loads(metadata["meta"])


def read_shard(path: Path) -> list[Example]:
    with safe_open(str(path), "pt") as f:
        ids = json.loads(f.metadata()["ids"])
        t = {name: f.get_tensor(name) for name in f.keys()}
    offsets = t["offsets"].tolist()
    out = []
    for i, conv_id in enumerate(ids):
        a, b = offsets[i], offsets[i + 1]
        out.append(Example(
            id=conv_id,
            input_ids=t["input_ids"][a:b].long(),
            loss_mask=t["loss_mask"][a:b].float(),
            hidden=t["hidden"][a:b],
            topk_probs=t["topk_probs"][a:b] if "topk_probs" in t else None,
            topk_ids=t["topk_ids"][a:b].long() if "topk_ids" in t else None,
            aux=t["aux"][a:b] if "aux" in t else None,
        ))
    return out


# --- the target side -------------------------------------------------------------------------------------------

@torch.no_grad()
def target_features(target: Target, sequences: Sequence[Sequence[int]], top_k: int,
                    layers: Sequence[int] = ()) -> list[tuple[torch.Tensor | None, ...]]:
    """One right-padded forward of the target over `sequences`: per sequence (hidden [L,d], top-K probs, ids,
    aux [L, len(layers)*d] = the `hidden_states` of `layers` concatenated, None without layers), computed on
    the target's device and stored as CPU copies."""
    model, device = target.model, target.device
    lengths = torch.tensor([len(s) for s in sequences], device=device)
    t = int(lengths.max())
    pad = target.tokenizer.pad_token_id or 0
    ids = torch.full((len(sequences), t), pad, dtype=torch.long, device=device)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long, device=device)
    attention = (torch.arange(t, device=device)[None, :] < lengths[:, None]).long()
    # no KV cache: nothing decodes after this forward (at 8B, 8 x 2,048 tokens would keep 2.1 GB of it)
    output = model.model(input_ids=ids, attention_mask=attention, output_hidden_states=bool(layers), use_cache=False)
    hidden = output.last_hidden_state  # post final norm
    aux = torch.cat([output.hidden_states[i] for i in layers], dim=-1) if layers else None
    lm_head = model.get_output_embeddings()
    out = []
    for i, n in enumerate(lengths.tolist()):
        h = hidden[i, :n]
        probs = torch.softmax(lm_head(h).float(), dim=-1)
        top = probs.topk(top_k, dim=-1)
        copies = tuple(x.to("cpu", copy=True) for x in (h, top.values, top.indices))
        out.append((*copies, None if aux is None else aux[i, :n].to("cpu", copy=True)))
    return out


def _ids_digest(conversations: Sequence[Any]) -> str:
    return hashlib.sha256("\n".join(str(c.id) for c in conversations).encode()).hexdigest()[:16]


def _shard_done(path: Path, conversations: Sequence[Any]) -> bool:
    """A complete shard (written atomically) built from these very conversations."""
    if not path.is_file():
        return False
    try:
        _, meta = read_shard_meta(path)
    except Exception:  # unreadable: redo it
        return False
    return meta.get("source") == _ids_digest(conversations)


# --- the extraction driver -------------------------------------------------------------------------------------

def conversation_digest(conversation: Any) -> str:
    """Digest of a source conversation's messages: features are reused across mixtures only when it matches."""
    return hashlib.sha256(json.dumps(conversation.messages, sort_keys=True).encode()).hexdigest()[:16]


class _Donors:
    """Finished feature sets with the same spec except the mixture: their conversations need no new forward pass.

    Mixtures drawn with the same seed share conversations (``mixed`` holds the heads of the ``math`` and
    ``chat`` samples), so a mixed set mostly copies the single-domain features instead of recomputing them.
    """

    def __init__(self, root: Path, spec: dict[str, Any], exclude: Path) -> None:
        self.index: dict[str, tuple[Path, str]] = {}
        self._cache: dict[Path, dict[str, Example]] = {}
        same = {k: v for k, v in spec.items() if k != "mixture"}
        for manifest_path in sorted(root.glob(f"*/{MANIFEST}")):
            if manifest_path.parent == exclude:
                continue
            try:
                manifest = json.loads(manifest_path.read_text())
            except (OSError, ValueError):
                continue
            if {k: v for k, v in manifest.get("spec", {}).items() if k != "mixture"} != same:
                continue
            for shard in manifest["shards"]:
                for conv_id, digest in zip(shard["ids"], shard.get("digests", [])):
                    self.index.setdefault(conv_id, (manifest_path.parent / shard["file"], digest))

    def get(self, conv_id: str, digest: str) -> Example | None:
        hit = self.index.get(conv_id)
        if hit is None or hit[1] != digest or not hit[0].is_file():
            return None
        path = hit[0]
        if path not in self._cache:
            if len(self._cache) >= 4:
                self._cache.pop(next(iter(self._cache)))
            self._cache[path] = {e.id: e for e in read_shard(path)}
        return self._cache[path].get(conv_id)


class NeedsTarget(Exception):
    """A shard has conversations to run through the target, and this process may not load it."""


class LazyTarget:
    """The target as a shard needs it: its tokenizer at once (cheap), the model on first `get()`, never when
    `may_load` is False (the driver copying donor shards raises `NeedsTarget` instead)."""

    def __init__(self, cfg: StudyConfig, target: Target | None = None, may_load: bool = True) -> None:
        self._cfg, self._target, self._may_load = cfg, target, may_load
        self._tokenizer = None

    @property
    def tokenizer(self):
        if self._target is not None:
            return self._target.tokenizer
        if self._tokenizer is None:
            self._tokenizer = with_pad_token(load_tokenizer(self._cfg.target.name))
        return self._tokenizer

    @property
    def loaded(self) -> bool:
        return self._target is not None

    def get(self) -> Target:
        if self._target is None:
            if not self._may_load:
                raise NeedsTarget()
            self._target = load_target(self._cfg.target)
        return self._target


def answers_path(shard: Path) -> Path:
    """The answer cache of a shard of a target-answer set (`AnswerCache`), beside the shard."""
    return shard.with_name(f"answers-{shard.stem}.jsonl")


def _extract_shard(source: LazyTarget, conversations: Sequence[Any], cfg: StudyConfig, bar: tqdm | None,
                   donors: _Donors | None = None, answers: Path | None = None) -> tuple[list[Example], dict]:
    """`answers`: the shard's answer cache when the set trains on target answers, None for dataset answers.
    The target is loaded (`source.get()`) only when some conversation is not copied from a donor."""
    f = cfg.features
    start, cpu_start = time.perf_counter(), time.process_time()
    meta: dict[str, Any] = {"input": len(conversations), "source": _ids_digest(conversations)}
    digests = {c.id: conversation_digest(c) for c in conversations}
    copied: dict[str, Example] = {}
    if donors is not None:
        for conv in conversations:
            example = donors.get(conv.id, digests[conv.id])
            if example is not None:
                copied[conv.id] = example
    todo = [c for c in conversations if c.id not in copied]
    if answers is not None and todo:
        cache = AnswerCache(answers, {c.id: digests[c.id] for c in todo})
        todo = regenerate_answers(source.get(), todo, f.batch_size, f.regenerate_max_new_tokens, f.max_len, cache, bar)
        meta["regenerated"] = len(todo)
        meta["regenerate_s"] = time.perf_counter() - start
    samples = []
    for conv in todo:
        ids, mask = tokenize_conversation(source.tokenizer, conv.messages, f.max_len)
        if len(ids) >= 2 and sum(mask) > 0:
            samples.append((conv.id, ids, mask))
    meta["skipped"] = len(conversations) - len(samples) - len(copied)
    extract_start, extract_cpu = time.perf_counter(), time.process_time()
    computed: dict[str, Example] = {}
    target = source.get() if samples else None
    layers = eagle3_layers(target.model.config.num_hidden_layers) if target and keeps_eagle3_layers(cfg) else []
    if target is not None:  # a shard copied whole records no layers of its own
        meta["aux_layers"] = layers
    for batch in length_batches([len(s[1]) for s in samples], f.batch_size):
        outs = target_features(target, [samples[i][1] for i in batch], f.top_k, layers)
        for i, (h, p, k, aux) in zip(batch, outs):
            conv_id, ids, mask = samples[i]
            computed[conv_id] = Example(conv_id, torch.tensor(ids), torch.tensor(mask, dtype=torch.float32), h, p, k,
                                        aux)
        if bar is not None:
            bar.update(sum(len(samples[i][1]) for i in batch))
    examples = [computed.get(c.id) or copied.get(c.id) for c in conversations]
    examples = [e for e in examples if e is not None]
    meta["digests"] = [digests[e.id] for e in examples]
    meta["tokens"] = sum(len(e) for e in examples)
    meta["computed_tokens"] = sum(len(s[1]) for s in samples)
    meta["copied"] = len(copied)
    meta["extract_s"] = time.perf_counter() - extract_start
    meta["extract_cpu_s"] = time.process_time() - extract_cpu
    meta["total_s"] = time.perf_counter() - start
    meta["total_cpu_s"] = time.process_time() - cpu_start
    return examples, meta


# (the plan, its missing shards) -> (tokens run through the target, torch threads of the processes that ran them)
ShardRunner = Callable[["ShardPlan", list[tuple[str, list[Any]]]], tuple[int, int | None]]


def extract_features(cfg: StudyConfig, mixture_name: str, target: Target | None = None,
                     progress: bool = True, run_shards: ShardRunner | None = None) -> FeatureSet:
    """The cached features of `mixture_name`, extracting the missing shards first (in this process, or by
    `run_shards`, e.g. Ray tasks). Returns the set with stats: conversations, tokens, tokens_per_s (of the
    extraction that produced them), reused (nothing was extracted now)."""
    folder = features_folder(cfg, mixture_name)
    finished = _finished(folder)
    if finished is not None:
        return finished
    with folder_lock(folder):  # a second process (a sweep trial, a report) waits, then finds the set done
        finished = _finished(folder)  # another process may have finished the set while this one waited
        return finished if finished is not None else _extract_features(cfg, mixture_name, target, progress, run_shards)


def _finished(folder: Path) -> FeatureSet | None:
    """The feature set in `folder` when its manifest (written last) exists, else None."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        return None
    manifest = json.loads(manifest_path.read_text())
    return FeatureSet(folder, manifest, {**manifest["stats"], "reused": True, "extracted_shards": 0})


def _extract_features(cfg: StudyConfig, mixture_name: str, target: Target | None, progress: bool,
                      run_shards: ShardRunner | None) -> FeatureSet:
    plan = plan_shards(cfg, mixture_name)
    missing = copy_donor_shards(cfg, plan.folder, plan.spec, plan.missing())
    if run_shards is None:
        extracted_tokens, threads = extract_shards(cfg, plan.folder, plan.spec, missing, target, progress), torch.get_num_threads()
    else:
        extracted_tokens, threads = run_shards(plan, missing)
    return write_manifest(plan, len(missing), extracted_tokens, threads)


@dataclass
class ShardPlan:
    """How a feature set is cut into shards: `features.shard_size` conversations per file, in mixture order."""

    folder: Path
    spec: dict[str, Any]
    conversations: list[Any]
    shards: list[tuple[str, list[Any]]]  # (file name, its conversations)

    def missing(self) -> list[tuple[str, list[Any]]]:
        """The shards not yet written (or written from other conversations)."""
        return [(name, chunk) for name, chunk in self.shards if not _shard_done(self.folder / name, chunk)]


def plan_shards(cfg: StudyConfig, mixture_name: str) -> ShardPlan:
    """Prepare the set's folder (its spec, no half-written files of a killed run) and cut the mixture into
    shards. The caller holds the set's `folder_lock`: extractions writing this set must not be running."""
    folder = features_folder(cfg, mixture_name)
    folder.mkdir(parents=True, exist_ok=True)
    for leftover in folder.glob(".*.tmp-*"):  # half-written files of a killed run
        leftover.unlink(missing_ok=True)
    spec = feature_spec(cfg, mixture_name)
    atomic_write_json(folder / "spec.json", spec)
    conversations = build_mixture(cfg.mixtures[mixture_name], data_dir=cfg.resolved_data_dir())
    size = cfg.features.shard_size
    shards = [(f"shard-{i // size:05d}.safetensors", conversations[i: i + size]) for i in range(0, len(conversations), size)]
    return ShardPlan(folder, spec, conversations, shards)


def extract_shards(cfg: StudyConfig, folder: Path, spec: dict[str, Any], shards: Sequence[tuple[str, Sequence[Any]]],
                   target: Target | None = None, progress: bool = False) -> int:
    """Write each of `shards` (file name, conversations) into `folder` that is not done yet, one atomic file
    each, so a killed or retried run resumes shard by shard. Loads the target only when there is work.
    Returns the tokens run through the target."""
    todo = [(name, chunk) for name, chunk in shards if not _shard_done(folder / name, chunk)]
    if not todo:
        return 0
    source = LazyTarget(cfg, target)
    donors = _Donors(folder.parent, spec, folder)
    log.info("features %s: extracting %d shards (%d conversations available from other mixtures)",
             folder.name, len(todo), len(donors.index))
    bar = tqdm(total=None, desc=f"features {folder.name}", unit="tok", unit_scale=True, disable=not progress)
    run_start = time.perf_counter()
    extracted_tokens = 0
    try:
        for done, (name, chunk) in enumerate(todo, start=1):
            answers = answers_path(folder / name) if spec["regenerate"] else None
            examples, meta = _extract_shard(source, chunk, cfg, bar, donors, answers)
            write_shard(folder / name, examples, meta)
            extracted_tokens += meta["computed_tokens"]
            elapsed = time.perf_counter() - run_start
            bar.set_postfix(shard=f"{done}/{len(todo)}", tok_s=f"{extracted_tokens / max(elapsed, 1e-9):.0f}")
            if not progress:  # in a Ray task: a line per shard, which Ray forwards to the driver's log
                left = elapsed / done * (len(todo) - done) / 60
                print(f"features {folder.name}: shard {done}/{len(todo)}, {extracted_tokens / max(elapsed, 1e-9):.0f} "
                      f"tokens/s, about {left:.0f} min left", flush=True)
    finally:
        bar.close()
    return extracted_tokens


def copy_donor_shards(cfg: StudyConfig, folder: Path, spec: dict[str, Any],
                      shards: Sequence[tuple[str, Sequence[Any]]]) -> list[tuple[str, Sequence[Any]]]:
    """Write here, without the target, every shard of `shards` that needs none (each conversation copied from a
    donor set or too short to train on); returns the shards left for a process holding the target."""
    if not shards:
        return []
    donors = _Donors(folder.parent, spec, folder)
    if not donors.index:
        return list(shards)
    source = LazyTarget(cfg, may_load=False)
    left = []
    for name, chunk in shards:
        try:
            answers = answers_path(folder / name) if spec["regenerate"] else None
            examples, meta = _extract_shard(source, chunk, cfg, None, donors, answers)
        except NeedsTarget:
            left.append((name, chunk))
            continue
        write_shard(folder / name, examples, meta)
    log.info("features %s: %d of %d missing shards copied from donor sets", folder.name, len(shards) - len(left),
             len(shards))
    return left


def write_manifest(plan: ShardPlan, extracted_shards: int, extracted_tokens: int,
                   torch_threads: int | None) -> FeatureSet:
    """Mark the set complete once every shard of `plan` exists: its manifest, with stats summed over shards."""
    missing = [name for name, _ in plan.missing()]
    if missing:
        raise RuntimeError(f"features {plan.folder.name}: shards {missing} are missing; the set is not complete")
    folder, conversations, spec = plan.folder, plan.conversations, plan.spec
    manifest_path = folder / MANIFEST
    shard_files = [name for name, _ in plan.shards]
    shards, n = [], 0
    totals = {"tokens": 0, "computed_tokens": 0, "copied": 0, "extract_s": 0.0, "extract_cpu_s": 0.0,
              "regenerate_s": 0.0}
    for name in shard_files:
        ids, meta = read_shard_meta(folder / name)
        shards.append({"file": name, "ids": ids, "digests": meta["digests"], "tokens": meta["tokens"]})
        for key in totals:
            totals[key] += meta.get(key, 0)
        n += len(ids)
    seconds, cpu = totals["extract_s"], totals["extract_cpu_s"]
    stats = {
        "conversations": n,
        "source_conversations": len(conversations),
        "tokens": totals["tokens"],
        "computed_tokens": totals["computed_tokens"],
        "copied_conversations": totals["copied"],
        "extract_s": round(seconds, 3),
        "extract_cpu_s": round(cpu, 3),
        "tokens_per_s": round(totals["computed_tokens"] / seconds, 1) if seconds > 0 else None,
        "tokens_per_cpu_s": round(totals["computed_tokens"] / cpu, 1) if cpu > 0 else None,
        "regenerate_s": round(totals["regenerate_s"], 3) if spec["regenerate"] else None,
        "torch_threads": torch_threads,
    }
    manifest = {"key": folder.name, "spec": spec, "shards": shards, "stats": stats, "created": time.time()}
    atomic_write_json(manifest_path, manifest)
    log.info("features %s: %d conversations, %d tokens (%d computed), %.0f tokens/s", folder.name, n,
             stats["tokens"], stats["computed_tokens"], stats["tokens_per_s"] or 0)
    return FeatureSet(folder, manifest, {**stats, "reused": False, "extracted_shards": extracted_shards,
                                         "extracted_tokens": extracted_tokens})
