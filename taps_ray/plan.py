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
import yaml

from taps_ray import ray_requests
from taps_ray.config import TINY_TARGETS, StudyConfig, load_config
from taps_ray.fsio import atomic_write_text
from taps_ray.models.draft_head import DraftHead, DraftHeadConfig, eagle3_layers
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
EVAL_CONTEXT = 4_096  # tokens a decoding sequence may reach (MT-Bench's second turns: ~2,400 at 1,024 new per turn)
CUDA_CONTEXT = 1.5 * GB  # CUDA context and allocator slack per GPU process
LIBRARIES = 3.0 * GB  # Python, torch, CUDA and transformers libraries in host memory
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
    return Shapes(config, total, embed.numel(), 0 if tied else out.numel(), heads)


@dataclass
class Need:
    """What one actor kind needs: GPU and host bytes, each with its terms (label, bytes)."""

    kind: str
    gpu: list[tuple[str, float]] = field(default_factory=list)
    host: list[tuple[str, float]] = field(default_factory=list)

    @property
    def gpu_bytes(self) -> float:
        return sum(b for _, b in self.gpu)

    @property
    def host_bytes(self) -> float:
        return sum(b for _, b in self.host)


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


def needs(cfg: StudyConfig, s: Shapes) -> dict[str, Need]:
    """GPU and host memory of each actor kind (`ray_requests.KINDS`)."""
    w = _dtype_bytes(cfg.target.dtype)
    eval_w = _dtype_bytes(cfg.eval.dtype or cfg.target.dtype)
    d, v, inter = s.hidden, s.vocab, s.config.intermediate_size
    kv = s.kv_bytes_per_token
    weights = s.total * w
    heads_loaded = sum(s.head[k] for k in cfg.train.kinds) * len(cfg.head_mixtures())
    tree = cfg.tree.total_token
    out: dict[str, Need] = {}

    batch = cfg.ray.max_batch
    out["target_worker"] = Need("target_worker", gpu=[
        ("weights", s.total * eval_w),
        (f"KV cache, {batch} sequences x {EVAL_CONTEXT:,} tokens", batch * EVAL_CONTEXT * kv),
        (f"verification forward: logits {batch} x {tree} x V, fp32 softmax", batch * tree * v * (eval_w + 4)),
        ("CUDA context, allocator slack", CUDA_CONTEXT),
    ], host=[("libraries", LIBRARIES), ("weights staged on the CPU", s.total * eval_w)])

    sessions = cfg.eval.batch_size
    vocab_rows = cfg.tree.draft_vocab_size or v
    out["drafter"] = Need("drafter", gpu=[
        ("embeddings + LM head", s.parts * eval_w),
        (f"heads: {len(cfg.train.kinds)} kind(s) x {len(cfg.head_mixtures())} mixtures", heads_loaded * eval_w),
        (f"its KV cache (one layer), {sessions} x {EVAL_CONTEXT:,} tokens",
         sessions * EVAL_CONTEXT * kv / s.config.num_hidden_layers),
        ("drafting one depth: fp32 softmax", sessions * cfg.tree.top_k * vocab_rows * 4),
        ("CUDA context, allocator slack", CUDA_CONTEXT),
    ], host=[("libraries", LIBRARIES), ("embeddings + LM head read from the checkpoint", s.parts * eval_w),
             ("packed heads, fp32, from the object store", heads_loaded * 4)])

    fb, length = cfg.features.batch_size, cfg.features.max_len
    out["features_task"] = Need("features_task", gpu=[
        ("weights", weights),
        (f"forward of {fb} x {length:,} tokens: hidden + MLP activations", fb * length * (d + 3 * inter) * w),
        ("per sequence: LM head + fp32 softmax", length * v * (w + 4)),
        ("CUDA context, allocator slack", CUDA_CONTEXT),
    ], host=[("libraries", LIBRARIES), ("weights staged on the CPU", weights),
             ("one shard of output", shard_bytes(cfg, s))])

    n = cfg.train.batch_size * cfg.features.max_len
    passes = cfg.train.hca_passes if {"hass", "eagle3"} & set(cfg.train.kinds) else 1
    head = max(s.head[k] for k in cfg.train.kinds)
    out["tune_trial"] = Need("tune_trial", gpu=[
        ("embeddings + LM head, fp32 (no decoder layer: features are cached)", s.parts * 4),
        ("head weights, gradients, AdamW moments, fp32", 4 * head * 4),
        (f"target distributions, {n:,} scored tokens x V, fp32", n * vocab_rows * 4),
        (f"head log-probabilities, {passes} pass(es), kept for backward", passes * n * vocab_rows * 4),
        (f"layer activations, {passes} pass(es), fp32", passes * n * (3 * inter + 8 * d) * 4),
        ("CUDA context, allocator slack", CUDA_CONTEXT),
    ], host=[("libraries", LIBRARIES), ("embeddings + LM head cast to fp32 on the CPU", s.parts * 4),
             (f"train.shuffle_shards = {cfg.train.shuffle_shards} feature shards",
              cfg.train.shuffle_shards * shard_bytes(cfg, s))])

    sv = cfg.serve
    serve_heads = s.head[sv.head_kind] * len(cfg.head_mixtures(sv.head_kind))
    context = sv.max_prompt_tokens + sv.max_tokens_limit + tree
    out["serve_replica"] = Need("serve_replica", gpu=[
        ("weights", s.total * eval_w),
        (f"KV cache, {sv.max_batch_size} sequences x {context:,} tokens", sv.max_batch_size * context * kv),
        (f"heads of {sv.head_kind}", serve_heads * eval_w),
        (f"verification forward: logits {sv.max_batch_size} x {tree} x V, fp32 softmax",
         sv.max_batch_size * tree * v * (eval_w + 4)),
        ("CUDA context, allocator slack", CUDA_CONTEXT),
    ], host=[("libraries", LIBRARIES), ("weights staged on the CPU", s.total * eval_w),
             ("heads read from disk, fp32", serve_heads * 4)])
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
    config = yaml.safe_load(Path(path).read_text())
    return [NodeType(name, dict(t.get("resources", {})), t.get("node_config", {}).get("InstanceType", ""))
            for name, t in config["available_node_types"].items()]


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
        if need.gpu_bytes > share:
            return Fit(node.name, True, False, f"needs {need.gpu_bytes / GB:.1f} GB of GPU memory, its "
                       f"{request.num_gpus:g} x {node.accelerator} share holds {share / GB:.1f} GB")
        why = f"{need.gpu_bytes / GB:.1f} of {share / GB:.1f} GB GPU"
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
        if request.memory is None:
            problems.append(f"declares no host memory: set {MEMORY_FIELDS[kind]}: {math.ceil(need.host_bytes / GB)}")
        elif request.memory < need.host_bytes:
            problems.append(f"{MEMORY_FIELDS[kind]} = {request.memory / GB:g} is below the {need.host_bytes / GB:.1f} GB "
                            f"it holds: raise it to {math.ceil(need.host_bytes / GB)}")
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
             f"Assumptions: evaluation context {EVAL_CONTEXT:,} tokens per sequence; average conversation "
             + ", ".join(f"{c} {n:,} tokens" for c, n in AVG_TOKENS.items())
             + f"; CUDA context {CUDA_CONTEXT / GB:g} GB per GPU process; libraries {LIBRARIES / GB:g} GB of host "
               "memory. GB = 10^9 bytes.", ""]
    results = verdicts(cfg, s, nodes)
    lines += ["## Actors", "", "| actor | GPU memory | host memory | Ray request | verdict |", "|---|---:|---:|---|---|"]
    for v in results:
        lines.append(f"| {v.kind} | {_gb(v.need.gpu_bytes)} | {_gb(v.need.host_bytes)} | "
                     f"`{json.dumps(v.request.bundle())}` | {'fits' if v.ok else 'DOES NOT FIT'} |")
    for v in results:
        lines += ["", f"### {v.kind}", "", "| term | GPU | host |", "|---|---:|---:|"]
        lines += [f"| {label} | {_gb(b)} | |" for label, b in v.need.gpu]
        lines += [f"| {label} | | {_gb(b)} |" for label, b in v.need.host]
        lines.append(f"| **total** | **{_gb(v.need.gpu_bytes)}** | **{_gb(v.need.host_bytes)}** |")
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


def write_into(doc: Path, text: str) -> None:
    """Replace the generated block of `doc` (between BEGIN and END) by `text`, atomically."""
    body = doc.read_text()
    if BEGIN not in body or END not in body:
        raise ValueError(f"{doc} has no generated block: add the lines {BEGIN} and {END} where the plan goes")
    head, rest = body.split(BEGIN, 1)
    atomic_write_text(doc, f"{head}{BEGIN}\n{text}\n{END}{rest.split(END, 1)[1]}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="study config, e.g. configs/paper.yaml")
    parser.add_argument("--cluster", default=None, help="Ray cluster config whose node types to check, e.g. cluster.yaml")
    parser.add_argument("--model-config", default=None, help="the target's config.json (offline); default: "
                        "configs/models/ for known targets, else the model's folder or Hub id")
    parser.add_argument("--doc", default=None, help="write the plan into this markdown file's generated block")


def command_line(args: argparse.Namespace) -> str:
    parts = ["taps plan", f"--config {args.config}"]
    parts += [f"--cluster {args.cluster}"] if args.cluster else []
    parts += [f"--model-config {args.model_config}"] if args.model_config else []
    return " ".join(parts)


def build(args: argparse.Namespace) -> tuple[str, bool]:
    """(markdown, every actor fits)."""
    cfg = load_config(args.config)
    s = shapes(model_config(cfg, args.model_config), cfg.train.kinds)
    nodes = node_types(args.cluster) if args.cluster else None
    return render(cfg, s, nodes, command_line(args)), all(v.ok for v in verdicts(cfg, s, nodes))


def cmd_plan(args: argparse.Namespace) -> int:
    text, ok = build(args)
    if args.doc:
        write_into(Path(args.doc), text)
    print(text)
    return 0 if ok else 1
