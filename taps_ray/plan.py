"""`taps plan`: what each actor kind of a study needs in GPU memory, host memory and disk, and whether it fits
the node types of a Ray cluster config, with the Ray request that follows.

    taps plan --config configs/paper.yaml --cluster cluster.yaml [--model-config configs/models/x.json]

The parameter bytes are exact: the target is instantiated from its `config.json` on the `meta` device (no
weight is allocated or downloaded), and so is a draft head. The rest is arithmetic over the config's sizes: KV
cache for the configured batch and length, training activations, feature bytes per token. Where a figure rests
on an assumption (average conversation length, evaluation context), the assumption is a named constant below and
printed with the plan. Every actor's Ray request comes from `ray_requests`, the module the actors themselves
take theirs from, so what the plan prints is what Ray is asked for (tests/test_paper_dry_run.py checks it).
docs/paper_plan.md's tables are this module's output for configs/paper.yaml and cluster.yaml.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

from taps_ray import ray_requests
from taps_ray.cluster_file import read_cluster
from taps_ray.config import TINY_TARGETS, StudyConfig, load_config
from taps_ray.fsio import atomic_write_text
from taps_ray.decoding.replay_draft import NODE_BUDGET
from taps_ray.drafting.registry import draft_reach
from taps_ray.models.draft_head import DraftHead, DraftHeadConfig, eagle3_layers
from taps_ray.models.kv_cache import grown_capacity, previous_capacity
from taps_ray.models.target import load_tokenizer, model_source, tiny_model_config
from taps_ray.ray_requests import RayRequest

REPO = Path(__file__).resolve().parents[1]
GB = 1e9
# offline copies of the targets' config.json (configs/models/README.md)
KNOWN_CONFIGS = {
    "meta-llama/Meta-Llama-3-8B-Instruct": REPO / "configs" / "models" / "llama-3-8b-instruct.json",
    "smollm2-135m-instruct": REPO / "configs" / "models" / "smollm2-135m-instruct.json",
}
# GPU memory as nvidia-smi reports memory.total (MiB), by Ray's accelerator type
GPU_MEMORY_MIB = {"A10G": 23_028, "L4": 23_034, "A100": 40_960, "A100-80G": 81_920, "L40S": 46_068,
                  "H100": 81_559, "H200": 143_771}
# assumptions, each printed with the plan
AVG_TOKENS = {"mathinstruct": 300, "sharegpt": 1_100}  # tokens per conversation after truncation, chat template on
PROMPT_TOKENS = 400  # the longest question with the system prompt and chat template (the paper's benchmarks)
TURNS = {"mt_bench": 2}  # turns per question (others: 1); a later turn's prompt carries the earlier answers
CUDA_CONTEXT = 1.5 * GB  # CUDA context and allocator slack per GPU process
LIBRARIES = 3.0 * GB  # Python, torch, CUDA and transformers libraries in host memory
HEADROOM = 0.10  # an actor fits when its need leaves this share of its GPU (and of its host memory request) free
# on a GPU, SDPA runs a fused kernel (flash or memory-efficient) that allocates no [heads, T, T] attention scores;
# the CPU's math path does (benchmarks/gpu/gpu_smoke.py reports which kernel a GPU runs)
FUSED_ATTENTION = True
TREE_BYTES = 8 + 8 + 4 + 4  # a drafted node kept for replay: token, parent (int64), confidence, entropy (fp32)
# bytes per logit that verifying a tree by sampling (T > 0) allocates beside the logits themselves: its fp32
# probabilities, residuals and draws (measured: tests/test_memory_plan.py; greedy verification allocates none)
SAMPLING_BYTES = 15
ACCELERATOR_PREFIX = "accelerator_type:"


@dataclass
class Shapes:
    """The target's shape and exact parameter counts, from its config on the `meta` device."""

    config: Any
    total: int
    embed: int
    lm_head: int  # 0 when tied to the embeddings
    head: dict[str, int]  # parameters of one draft head, per kind

    @property
    def hidden(self) -> int:
        return self.config.hidden_size

    @property
    def vocab(self) -> int:
        return self.config.vocab_size

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer, one token, in 2 bytes."""
        c = self.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 2

    feature_width: int = 0  # values per position of the features replay keeps (d, or 3d with EAGLE-3)

    @property
    def parts(self) -> int:
        """A drafter's (and a trial's) share of the target: embeddings + LM head."""
        return self.embed + (self.lm_head or 0)


def model_config(cfg: StudyConfig, path: str | Path | None = None) -> Any:
    """The target's config: `path`, else the offline copy of a known target, the tiny settings, or the
    `config.json` of its folder or Hub id (online)."""
    if path is not None:
        path = Path(path)
        return transformers.AutoConfig.from_pretrained(path) if path.is_dir() else _config_file(path)
    name = cfg.target.name
    if name in KNOWN_CONFIGS:
        return _config_file(KNOWN_CONFIGS[name])
    if name in TINY_TARGETS:
        return tiny_model_config(cfg.target, load_tokenizer(name))
    return transformers.AutoConfig.from_pretrained(model_source(name))


def _config_file(path: Path) -> Any:
    if not path.is_file():
        raise FileNotFoundError(f"model config {path} not found; pass --model-config <a config.json>")
    data = json.loads(path.read_text())
    return transformers.AutoConfig.for_model(data.pop("model_type"), **data)


def shapes(config: Any, kinds: list[str]) -> Shapes:
    """Exact parameter counts: the model and one head per kind built on the `meta` device."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
        heads = {}
        for kind in kinds:
            extra: dict[str, Any] = {"kind": kind}
            if kind == "eagle3":
                extra.update(feature_layers=eagle3_layers(config.num_hidden_layers), fc_bias=False)
            heads[kind] = sum(p.numel() for p in DraftHead(DraftHeadConfig.from_target(config, **extra)).parameters())
    total = sum(p.numel() for p in model.parameters())  # parameters() yields a tied matrix once
    embed = model.get_input_embeddings().weight
    out = model.get_output_embeddings().weight
    tied = out is embed
    width = config.hidden_size * (3 if "eagle3" in kinds else 1)
    return Shapes(config, total, embed.numel(), 0 if tied else out.numel(), heads, width)


HELD, TRANSIENT, FIXED = "held", "transient", "fixed"


@dataclass(frozen=True)
class Term:
    """One memory term: its bytes, the config setting that bounds it, and whether the actor keeps it (HELD), needs
    it during one computation (TRANSIENT: an actor runs one at a time, so only its largest counts) or pays it
    whatever the config (FIXED: CUDA context, libraries)."""

    label: str
    bytes: float
    knob: str
    kind: str = HELD


@dataclass
class Need:
    """What one actor kind needs in GPU and host memory, term by term."""

    kind: str
    gpu: list[Term] = field(default_factory=list)
    host: list[Term] = field(default_factory=list)

    @property
    def gpu_bytes(self) -> float:
        return total(self.gpu)

    @property
    def host_bytes(self) -> float:
        return total(self.host)


def total(terms: list[Term], kinds: tuple[str, ...] = (HELD, TRANSIENT, FIXED)) -> float:
    """Held and fixed terms add up; of the transient ones only the largest counts (one computation at a time)."""
    held = sum(t.bytes for t in terms if t.kind != TRANSIENT and t.kind in kinds)
    peak = max((t.bytes for t in terms if t.kind == TRANSIENT), default=0.0) if TRANSIENT in kinds else 0.0
    return held + peak


def _dtype_bytes(name: str) -> int:
    return torch.finfo(getattr(torch, name)).bits // 8


def shard_bytes(cfg: StudyConfig, s: Shapes) -> float:
    """The largest feature shard: `features.shard_size` conversations of the longest corpus."""
    longest = max(min(n, cfg.features.max_len) for n in AVG_TOKENS.values())
    return cfg.features.shard_size * longest * feature_bytes_per_token(cfg, s)


def feature_bytes_per_token(cfg: StudyConfig, s: Shapes) -> int:
    """hidden (bf16) + top-K probabilities (fp16) and ids (int32) + token id + loss mask (+ EAGLE-3's 3 layers)."""
    k = cfg.features.top_k
    per = s.hidden * 2 + k * 2 + k * 4 + 4 + 1
    if "eagle3" in cfg.train.kinds:
        per += 3 * s.hidden * _dtype_bytes(cfg.target.dtype)
    return per


def eval_context(cfg: StudyConfig) -> tuple[int, int]:
    """(prefill, final) slots of the longest decoding sequence: the last turn's prompt (earlier answers
    included), then `max_new_tokens`, the replay's lookahead and one verified tree past it."""
    turns = max(TURNS.get(b, 1) for b in cfg.eval.benchmarks)
    prefill = PROMPT_TOKENS + (turns - 1) * cfg.eval.max_new_tokens
    return prefill, prefill + cfg.eval.max_new_tokens + draft_reach(cfg.tree) + cfg.tree.total_token + 1


def trace_tokens(cfg: StudyConfig, benchmark: str) -> tuple[int, int]:
    """(positions with features, root positions with drafted trees) of one question's greedy traces, all turns:
    each turn's prompt (earlier answers included) and answer, `max_new_tokens` at most, plus the lookahead."""
    new, reach = cfg.eval.max_new_tokens, draft_reach(cfg.tree)
    turns = TURNS.get(benchmark, 1)
    return sum(PROMPT_TOKENS + t * new + new + reach for t in range(turns)), turns * new


def needs(cfg: StudyConfig, s: Shapes) -> dict[str, Need]:
    """GPU and host memory of each actor kind (`ray_requests.KINDS`), each term with the knob that bounds it."""
    w = _dtype_bytes(cfg.target.dtype)
    eval_w = _dtype_bytes(cfg.eval.dtype or cfg.target.dtype)
    d, v, inter = s.hidden, s.vocab, s.config.intermediate_size
    layers = s.config.num_hidden_layers
    kv = s.kv_bytes_per_token * eval_w // 2  # kv_bytes_per_token counts 2-byte values
    ev, r, tree = cfg.eval, cfg.ray, cfg.tree.total_token
    mixtures = len(cfg.head_mixtures())
    heads_loaded = sum(s.head[k] for k in cfg.train.kinds) * mixtures
    kind_heads = max(s.head[k] for k in cfg.train.kinds) * mixtures  # a drafter holds one kind's heads at a time
    vocab_rows = cfg.tree.draft_vocab_size or v

    math_path = cfg.target.device == "cpu" or not FUSED_ATTENTION

    def scores(rows: int, length: int, width: int) -> float:
        """A padded prefill's attention: its boolean mask, and on the CPU (SDPA's math path) one layer's scores
        per head; on a GPU SDPA's fused kernels take the mask and allocate no scores (FUSED_ATTENTION)."""
        return rows * length * length * ((s.config.num_attention_heads * width if math_path else 0) + 1)

    CUDA = Term("CUDA context, allocator slack", CUDA_CONTEXT, "-", FIXED)
    libraries = Term("libraries", LIBRARIES, "-", FIXED)
    prefill, final = eval_context(cfg)
    capacity, grown_from = grown_capacity(prefill, final), previous_capacity(prefill, final)
    # rows a session holds: a live cell's questions, or a replayed cell's; one session per drafter at a time
    session = max(ev.batch_size, ev.replay_batch if ev.replay else 0)
    per_worker = math.ceil(r.num_drafters / r.num_target_workers)
    out: dict[str, Need] = {}

    longest = final - tree - 1  # a replay's features forward: a whole prompt + answer + lookahead at once
    out["target_worker"] = Need("target_worker", gpu=[
        Term("weights", s.total * eval_w, "target.name, eval.dtype"),
        Term(f"KV cache: {per_worker} drafters x one session of {session} rows (replayed cells' sessions of "
             f"eval.replay_batch rows merge only up to ray.max_batch) x {capacity:,} slots (the doubling growth "
             f"from a {prefill:,}-token prefill to {final:,})", per_worker * session * capacity * kv,
             "eval.replay_batch, eval.batch_size, ray.num_drafters / ray.num_target_workers, eval.max_new_tokens"),
        Term(f"KV cache growth: the {grown_from:,}-slot copy held while every layer moves to {capacity:,} slots at "
             "once", per_worker * session * grown_from * kv,
             "eval.replay_batch, eval.batch_size, eval.max_new_tokens", TRANSIENT),
        Term(f"verification forward: logits {r.max_batch} x {tree + 1} x V and sampling them",
             r.max_batch * (tree + 1) * v * (eval_w + SAMPLING_BYTES), "ray.max_batch, tree.total_token", TRANSIENT),
        Term(f"prefill of {session} x {longest:,} tokens (a replay's features forward): one layer's activations "
             "and attention scores, the features kept", session * longest * (3 * d + 3 * inter + s.feature_width)
             * eval_w + scores(session, longest, eval_w), "eval.replay_batch, eval.max_new_tokens", TRANSIENT),
        CUDA,
    ], host=[libraries, Term("weights staged on the CPU", s.total * eval_w, "target.name, eval.dtype")])

    per_head = tree * TREE_BYTES  # one root position's drafted tree
    heads = mixtures  # the heads of one kind keep their trees along the traces

    def trace_bytes(benchmark: str, heads: int) -> float:
        """One question's traces: features at every position, trees of `heads` heads at every root."""
        positions, roots = trace_tokens(cfg, benchmark)
        return positions * s.feature_width * eval_w + roots * heads * per_head

    biggest = max(ev.benchmarks, key=lambda b: ev.benchmarks[b] * trace_bytes(b, heads))
    questions = ev.benchmarks[biggest]
    cache = questions * trace_bytes(biggest, heads) if ev.replay else 0.0
    batch = ev.replay_batch * max(trace_bytes(b, mixtures) for b in ev.benchmarks)
    positions, roots = trace_tokens(cfg, biggest)
    trace_label = (f"greedy traces of {biggest} ({questions:,} questions): features of {positions:,} positions, "
                   f"trees of {heads} heads at {roots:,} roots")
    on_gpu = ([Term(f"one replay batch of traces on the GPU: {ev.replay_batch} questions' features and trees",
                    batch, "eval.replay_batch, eval.max_new_tokens")] if ev.traces_on_host
              else [Term(trace_label, cache, "eval.traces_on_host, eval.benchmarks, eval.max_new_tokens")])
    on_host = [Term(trace_label, cache, "eval.traces_on_host, eval.benchmarks, eval.max_new_tokens")] if ev.traces_on_host else []
    out["drafter"] = Need("drafter", gpu=[
        Term("embeddings + LM head", s.parts * eval_w, "target.name, eval.dtype"),
        Term(f"heads of the kind being evaluated: {mixtures} mixtures", kind_heads * eval_w, "train.mixtures"),
        Term("a combination's stacked copy of them (drafting side by side)", kind_heads * eval_w, "train.mixtures"),
        Term(f"their KV caches (one layer each), {session} rows x {capacity:,} slots",
             mixtures * session * capacity * kv / layers, "eval.batch_size, eval.replay_batch"),
        *([t for t in on_gpu if t.bytes] if ev.replay else []),
        Term("drafting one depth: fp32 softmax", session * cfg.tree.top_k * vocab_rows * 4, "tree.top_k",
             TRANSIENT),
        Term(f"the heads' prefill over a live session's {ev.batch_size} prompts of {prefill:,} tokens: attention "
             "scores", mixtures * scores(ev.batch_size, prefill, eval_w), "eval.batch_size, train.mixtures",
             TRANSIENT),
        Term(f"replay drafting: {NODE_BUDGET:,} nodes x V logits and their fp32 log-probabilities",
             NODE_BUDGET * vocab_rows * (eval_w + 4) if ev.replay else 0.0, "eval.replay", TRANSIENT),
        CUDA,
    ], host=[libraries, Term("embeddings + LM head read from the checkpoint", s.parts * eval_w, "target.name"),
             Term("packed heads, fp32, from the object store", heads_loaded * 4, "train.kinds, train.mixtures"),
             *on_host])

    fb, length = cfg.features.batch_size, cfg.features.max_len
    out["features_task"] = Need("features_task", gpu=[
        Term("weights", s.total * w, "target.name, target.dtype"),
        Term(f"forward of {fb} x {length:,} tokens (hidden + MLP activations, attention scores), then per "
             "sequence its LM head + fp32 softmax beside the batch's outputs",
             fb * length * (d + 3 * inter) * w + scores(fb, length, w) + length * v * (w + 4),
             "features.batch_size, features.max_len", TRANSIENT),
        CUDA,
    ], host=[libraries, Term("weights staged on the CPU", s.total * w, "target.name"),
             Term("one shard of output", shard_bytes(cfg, s), "features.shard_size")])

    n = cfg.train.batch_size * cfg.features.max_len
    passes = cfg.train.hca_passes if {"hass", "eagle3"} & set(cfg.train.kinds) else 1
    head = max(s.head[k] for k in cfg.train.kinds)
    out["tune_trial"] = Need("tune_trial", gpu=[
        Term("embeddings + LM head, fp32 (no decoder layer: features are cached)", s.parts * 4, "target.name"),
        Term("head weights, gradients, AdamW moments, fp32", 4 * head * 4, "train.kinds"),
        Term(f"one step: target distributions of {n:,} scored tokens x V, and per pass ({passes}) the head's "
             "log-probabilities and layer activations kept for backward, fp32",
             n * vocab_rows * 4 + passes * n * (vocab_rows + 3 * inter + 8 * d) * 4,
             "train.batch_size, features.max_len, train.hca_passes", TRANSIENT),
        CUDA,
    ], host=[libraries, Term("embeddings + LM head cast to fp32 on the CPU", s.parts * 4, "target.name"),
             Term(f"train.shuffle_shards = {cfg.train.shuffle_shards} feature shards",
                  cfg.train.shuffle_shards * shard_bytes(cfg, s), "train.shuffle_shards, features.shard_size")])

    sv = cfg.serve
    serve_heads = s.head[sv.head_kind] * len(cfg.head_mixtures(sv.head_kind))
    serve_final = sv.max_prompt_tokens + sv.max_tokens_limit + tree + 1
    serve_capacity = grown_capacity(sv.max_prompt_tokens, serve_final)
    serve_grown_from = previous_capacity(sv.max_prompt_tokens, serve_final)
    out["serve_replica"] = Need("serve_replica", gpu=[
        Term("weights", s.total * eval_w, "target.name, eval.dtype"),
        Term(f"KV cache, {sv.max_batch_size} sequences x {serve_capacity:,} slots (grown to {serve_final:,})",
             sv.max_batch_size * serve_capacity * kv, "serve.max_batch_size, serve.max_prompt_tokens, "
             "serve.max_tokens_limit"),
        Term(f"KV cache growth: the {serve_grown_from:,}-slot copy held while every layer moves to "
             f"{serve_capacity:,} slots at once", sv.max_batch_size * serve_grown_from * kv,
             "serve.max_batch_size, serve.max_tokens_limit", TRANSIENT),
        Term(f"heads of {sv.head_kind}, and a combination's stacked copy of them", 2 * serve_heads * eval_w,
             "serve.head_kind, train.mixtures"),
        Term(f"their KV caches (one layer each), {sv.max_batch_size} sequences x {serve_capacity:,} slots",
             len(cfg.head_mixtures(sv.head_kind)) * sv.max_batch_size * serve_capacity * kv / layers,
             "serve.max_batch_size, serve.max_prompt_tokens, serve.max_tokens_limit"),
        Term(f"verification forward: logits {sv.max_batch_size} x {tree + 1} x V and sampling them",
             sv.max_batch_size * (tree + 1) * v * (eval_w + SAMPLING_BYTES), "serve.max_batch_size, tree.total_token",
             TRANSIENT),
        Term(f"prefill of {sv.max_batch_size} x {sv.max_prompt_tokens:,} tokens: activations, attention scores, "
             "then the heads' over them", sv.max_batch_size * sv.max_prompt_tokens * (3 * d + 3 * inter) * eval_w
             + (1 + len(cfg.head_mixtures(sv.head_kind))) * scores(sv.max_batch_size, sv.max_prompt_tokens, eval_w),
             "serve.max_batch_size, serve.max_prompt_tokens", TRANSIENT),
        CUDA,
    ], host=[libraries, Term("weights staged on the CPU", s.total * eval_w, "target.name"),
             Term("heads read from disk, fp32", serve_heads * 4, "serve.head_kind")])
    return out


@dataclass
class NodeType:
    name: str
    resources: dict[str, float]
    instance: str = ""

    @property
    def accelerator(self) -> str | None:
        return next((k.removeprefix(ACCELERATOR_PREFIX) for k in self.resources if k.startswith(ACCELERATOR_PREFIX)), None)

    @property
    def gpu_bytes(self) -> float | None:
        """Memory of one of its GPUs (None: no GPU, or an accelerator type the plan does not know)."""
        mib = GPU_MEMORY_MIB.get(self.accelerator or "")
        return None if mib is None or not self.resources.get("GPU") else mib * 2**20


def node_types(path: str | Path) -> list[NodeType]:
    """The node types of the Ray cluster config at `path` (validated: `cluster_file.read_cluster`)."""
    spec = read_cluster(path)
    return [NodeType(name, dict(t.resources), str(t.node_config.get("InstanceType", "")))
            for name, t in spec.available_node_types.items()]


@dataclass
class Fit:
    node: str
    placeable: bool  # Ray can place the request there (CPU, GPU, memory, custom resources)
    fits: bool  # placeable and the GPU memory share holds the need
    why: str


def fit(request: RayRequest, need: Need, node: NodeType) -> Fit:
    have = node.resources
    wanted = request.bundle()
    short = [f"{k} {amount:g} > {have.get(k, 0):g}" for k, amount in wanted.items() if amount > have.get(k, 0)]
    if short:
        return Fit(node.name, False, False, ", ".join(short))
    if request.num_gpus > 0:
        if node.gpu_bytes is None:
            return Fit(node.name, True, False, f"GPU memory of {node.accelerator or 'its GPU'} unknown to the plan")
        share = request.num_gpus * node.gpu_bytes
        if need.gpu_bytes > (1 - HEADROOM) * share:
            return Fit(node.name, True, False, f"needs {need.gpu_bytes / GB:.1f} GB of GPU memory, its "
                       f"{request.num_gpus:g} x {node.accelerator} share holds {share / GB:.1f} GB, "
                       f"{(1 - HEADROOM) * share / GB:.1f} GB with {HEADROOM:.0%} headroom")
        why = f"{need.gpu_bytes / GB:.1f} of {share / GB:.1f} GB GPU, {1 - need.gpu_bytes / share:.0%} free"
    else:
        why = "no GPU asked"
    return Fit(node.name, True, True, why)


@dataclass
class Verdict:
    kind: str
    request: RayRequest
    need: Need
    fits: list[Fit]
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


MEMORY_FIELDS = {"target_worker": "ray.target_memory_gb", "features_task": "ray.target_memory_gb",
                 "drafter": "ray.drafter_memory_gb", "tune_trial": "ray.trial_memory_gb",
                 "serve_replica": "serve.replica_memory_gb"}
GPU_FIELDS = {"target_worker": "ray.target_num_gpus", "features_task": "ray.target_num_gpus",
              "drafter": "ray.drafter_num_gpus", "tune_trial": "ray.trial_gpus", "serve_replica": "serve.replica_num_gpus"}
RESOURCE_FIELDS = {"target_worker": "ray.target_resources", "features_task": "ray.target_resources",
                   "drafter": "ray.drafter_resources", "tune_trial": "ray.trial_resources",
                   "serve_replica": "serve.replica_resources"}


def verdicts(cfg: StudyConfig, s: Shapes, nodes: list[NodeType] | None) -> list[Verdict]:
    """Per actor kind: its request, its needs, where it can go, and what does not fit with the fix."""
    out = []
    for kind, need in needs(cfg, s).items():
        request = ray_requests.request_of(cfg, kind)
        problems = []
        wanted = math.ceil(need.host_bytes / (1 - HEADROOM) / GB)
        if request.memory is None:
            problems.append(f"declares no host memory: set {MEMORY_FIELDS[kind]}: {wanted}")
        elif request.memory * (1 - HEADROOM) < need.host_bytes:
            problems.append(f"{MEMORY_FIELDS[kind]} = {request.memory / GB:g} leaves less than {HEADROOM:.0%} "
                            f"headroom over the {need.host_bytes / GB:.1f} GB it holds: raise it to {wanted}")
        if request.num_gpus == 0 and cfg.target.device != "cpu":
            problems.append(f"asks for no GPU, so it runs the target on the CPU: set {GPU_FIELDS[kind]}")
        fits = [fit(request, need, node) for node in nodes] if nodes is not None else []
        if nodes is not None:
            placeable = [f for f in fits if f.placeable]
            good = [f.node for f in fits if f.fits]
            if not placeable:
                problems.append("does not fit: no node type offers " + json.dumps(request.bundle()))
            for f in placeable:
                if not f.fits:
                    pin = next((n for n in nodes if n.name in good and n.accelerator), None)
                    fix = (f"pin it with {RESOURCE_FIELDS[kind]}: {{\"{ACCELERATOR_PREFIX}{pin.accelerator}\": 0.001}}"
                           if pin else "add a node type with a larger GPU to the cluster config")
                    problems.append(f"does not fit {f.node} ({f.why}), where Ray may place it: {fix}")
        out.append(Verdict(kind, request, need, fits, problems))
    return out


def disk(cfg: StudyConfig, s: Shapes) -> list[tuple[str, float, float, float]]:
    """(mixture, tokens, feature bytes, head checkpoint bytes) per mixture with heads."""
    per_token = feature_bytes_per_token(cfg, s)
    rows = []
    for name in cfg.head_mixtures():
        m = cfg.mixtures[name]
        total = sum(m.mixture.values())
        tokens = m.size * sum(r / total * min(AVG_TOKENS[c], cfg.features.max_len) for c, r in m.mixture.items())
        kinds = [k for k, mixture in cfg.head_pairs() if mixture == name]
        # every epoch folder stays (fp32 head), the newest with its AdamW moments, and `final`
        heads = sum((cfg.train.epochs + 2 + 1) * s.head[k] * 4 for k in kinds)
        rows.append((name, tokens, tokens * per_token, heads))
    return rows


def _gb(x: float) -> str:
    return f"{x / GB:,.2f} GB"


def render(cfg: StudyConfig, s: Shapes, nodes: list[NodeType] | None, command: str) -> str:
    """The plan as markdown."""
    lines = [f"Generated by `{command}`; regenerate it with the same command.", "",
             "## Model", "",
             f"`{cfg.target.name}` built on the meta device: hidden {s.hidden:,}, {s.config.num_hidden_layers} layers, "
             f"{s.config.num_attention_heads} query / {s.config.num_key_value_heads} KV heads, MLP "
             f"{s.config.intermediate_size:,}, vocabulary {s.vocab:,}, "
             f"{'tied' if not s.lm_head else 'untied'} embeddings.", "",
             "| part | parameters |", "|---|---:|",
             f"| target | {s.total:,} |", f"| embeddings | {s.embed:,} |",
             f"| LM head | {s.lm_head:,} |" if s.lm_head else "| LM head | tied to the embeddings |",
             *[f"| draft head ({kind}) | {n:,} |" for kind, n in s.head.items()],
             f"| KV cache per token | {s.kv_bytes_per_token:,} B |", "",
             f"Assumptions: the longest question {PROMPT_TOKENS:,} tokens with the system prompt, "
             + ", ".join(f"{b} {n} turns" for b, n in TURNS.items()) + " (others 1; a later turn's prompt carries "
             f"the earlier answers); average conversation "
             + ", ".join(f"{c} {n:,} tokens" for c, n in AVG_TOKENS.items())
             + f"; CUDA context {CUDA_CONTEXT / GB:g} GB per GPU process; libraries {LIBRARIES / GB:g} GB of host "
               "memory; on a GPU, SDPA's fused kernels allocate no attention scores (the CPU's math path does). "
               f"GB = 10^9 bytes. An actor fits when its need leaves {HEADROOM:.0%} of its GPU share and of "
               "its host memory request free. Terms: *held* (kept by the actor; `tests/test_memory_plan.py` measures "
               "them on the tiny config within 20%), *transient* (one computation; an actor runs one at a time, so "
               "only its largest counts in the total), *fixed* (whatever the config); each names the settings "
               "that bound it.", ""]
    results = verdicts(cfg, s, nodes)
    lines += ["## Actors", "", "| actor | GPU memory | host memory | Ray request | verdict |", "|---|---:|---:|---|---|"]
    for v in results:
        lines.append(f"| {v.kind} | {_gb(v.need.gpu_bytes)} | {_gb(v.need.host_bytes)} | "
                     f"`{json.dumps(v.request.bundle())}` | {'fits' if v.ok else 'DOES NOT FIT'} |")
    for v in results:
        lines += ["", f"### {v.kind}", "", "| term | kind | GPU | host | bounded by |", "|---|---|---:|---:|---|"]
        lines += [f"| {t.label} | {t.kind} | {_gb(t.bytes)} | | {t.knob} |" for t in v.need.gpu]
        lines += [f"| {t.label} | {t.kind} | | {_gb(t.bytes)} | {t.knob} |" for t in v.need.host]
        lines.append(f"| **total** | | **{_gb(v.need.gpu_bytes)}** | **{_gb(v.need.host_bytes)}** | |")
        if v.fits:
            lines += ["", "Node types: " + "; ".join(
                f"{f.node}: {'fits' if f.fits else ('does not fit' if f.placeable else 'not placed')} ({f.why})"
                for f in v.fits) + "."]
        lines += ["", *[f"- **{p}**" for p in v.problems]] if v.problems else []
    rows = disk(cfg, s)
    lines += ["", "## Disk per mixture", "",
              f"Features: {feature_bytes_per_token(cfg, s):,} B per token. Heads: fp32, every epoch kept "
              f"({cfg.train.epochs}), the newest with its AdamW moments, and `final`.", "",
              "| mixture | tokens | features | heads |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {tokens / 1e6:,.1f} M | {_gb(f)} | {_gb(h)} |" for name, tokens, f, h in rows]
    lines.append(f"| **all** | {sum(r[1] for r in rows) / 1e6:,.1f} M | **{_gb(sum(r[2] for r in rows))}** | "
                 f"**{_gb(sum(r[3] for r in rows))}** |")
    verdict = "every actor fits" if all(v.ok for v in results) else "some actors DO NOT FIT (above)"
    lines += ["", f"**Verdict: {verdict}.**", ""]
    return "\n".join(lines)


def resource_requests(cfg: StudyConfig) -> dict[str, RayRequest]:
    """The Ray request of every actor kind (`ray_requests.KINDS`), as the actors make them."""
    return {kind: ray_requests.request_of(cfg, kind) for kind in ray_requests.KINDS}


BEGIN, END = "<!-- taps plan: begin -->", "<!-- taps plan: end -->"


def check_doc(doc: Path) -> str:
    """The text of `doc` once it is a markdown file with a generated block (BEGIN ... END) for the plan."""
    if not doc.is_file():
        raise FileNotFoundError(f"--out {doc} not found; give an existing markdown file with the lines {BEGIN} and "
                                f"{END} where the plan goes (e.g. docs/paper_plan.md)")
    body = doc.read_text()
    if BEGIN not in body or END not in body:
        raise ValueError(f"{doc} has no generated block: add the lines {BEGIN} and {END} where the plan goes")
    return body


def write_into(doc: Path, text: str) -> None:
    """Replace the generated block of `doc` (between BEGIN and END) by `text`, atomically."""
    head, rest = check_doc(doc).split(BEGIN, 1)
    atomic_write_text(doc, f"{head}{BEGIN}\n{text}\n{END}{rest.split(END, 1)[1]}")


def command_line(args: argparse.Namespace) -> str:
    parts = ["taps plan", f"--config {args.config}"]
    parts += [f"--cluster {args.cluster}"] if args.cluster else []
    parts += [f"--model-config {args.model_config}"] if args.model_config else []
    return " ".join(parts)


def build(args: argparse.Namespace) -> tuple[str, bool]:
    """(markdown, every actor fits)."""
    cfg = load_config(args.config)
    nodes = node_types(args.cluster) if args.cluster else None  # before the model: a bad file fails at once
    s = shapes(model_config(cfg, args.model_config), cfg.train.kinds)
    return render(cfg, s, nodes, command_line(args)), all(v.ok for v in verdicts(cfg, s, nodes))


def cmd_plan(args: argparse.Namespace) -> int:
    if args.out:
        check_doc(Path(args.out))  # before the model's config is read
    text, ok = build(args)
    if args.out:
        write_into(Path(args.out), text)
    print(text)
    return 0 if ok else 1
