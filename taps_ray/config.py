"""Typed study configuration, loaded from YAML.

One file describes a whole study (target, data, mixtures, heads, tree, evaluation, Ray resources), so the
CPU default and the paper-scale run differ only in their YAML. Validation errors name the field and the fix.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

DType = Literal["float32", "bfloat16", "float16", "float64"]
Device = Literal["auto", "cpu", "cuda"]
HeadKind = Literal["eagle2", "hass", "eagle3"]
HEAD_KINDS: tuple[str, ...] = get_args(HeadKind)
DATA_DIR_ENV = "TAPS_DATA_DIR"


def check_head_kind(kind: str) -> str:
    """`kind` if it names a head kind, else a ValueError that lists them."""
    if kind not in HEAD_KINDS:
        raise ValueError(f"unknown head kind {kind!r}; use {' or '.join(HEAD_KINDS)}")
    return kind


TRAIN_CORPORA = ("mathinstruct", "sharegpt")
BENCHMARKS = ("mt_bench", "gsm8k", "math_500", "svamp")


def _known_and_positive(value: dict[str, Any], known: tuple[str, ...], noun: str, amount: str) -> dict[str, Any]:
    """`value` when every key is one of `known` and every number > 0 (a mixture's ratios, the benchmarks' question
    counts), else the error naming the first bad entry: "unknown {noun} ..." or "{amount} 'key' must be > 0"."""
    for key, number in value.items():
        if key not in known:
            raise ValueError(f"unknown {noun} {key!r}; use one of {', '.join(known)}")
        if number <= 0:
            raise ValueError(f"{amount} {key!r} must be > 0, got {number}")
    return value


class ConfigError(ValueError):
    """A config that cannot be used; the message names the file, the field and what to change."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


# The random tiny targets for fast tests, by alias: a Llama, and a Qwen3 (per-head q/k norms, head_dim twice
# hidden_size / heads as Qwen3-4B's 128 against 2560 / 32), both with the SmolLM2 tokenizer.
TINY_TARGETS = ("tiny-random-llama", "tiny-random-qwen3")


class TinyTargetConfig(_Strict):
    """The shape of a random tiny target (`TINY_TARGETS`), built from a config; it borrows the SmolLM2 tokenizer."""

    hidden_size: int = Field(64, gt=0)
    intermediate_size: int = Field(128, gt=0)
    num_hidden_layers: int = Field(2, gt=0)
    num_attention_heads: int = Field(4, gt=0)
    num_key_value_heads: int = Field(2, gt=0)
    vocab_size: int | None = Field(None, gt=0, description="defaults to the tokenizer's vocabulary size")
    seed: int = 0


class TargetConfig(_Strict):
    name: str = Field(
        "smollm2-135m-instruct",
        description="an alias (smollm2-135m-instruct, tiny-random-llama, tiny-random-qwen3), an HF Hub id, "
        "or a local HF folder",
    )
    dtype: DType = "bfloat16"
    attn_implementation: Literal["eager", "sdpa"] = "sdpa"
    forward: Literal["fast", "hf"] = Field(
        "fast", description="the verification forward: fast, taps' own forward for Llama, Mistral, Qwen2 and Qwen3 "
        "over the preallocated cache (fused projections, no per-step cache copy; transformers' is used where it "
        "does not cover the architecture); hf, transformers' decoder (docs/targets.md: every family's forward, "
        "or why it is refused). Both compute the same tokens (fp32 greedy)")
    compile: Literal["auto", "none", "inductor", "step"] = Field(
        "auto", description="auto: step on a GPU; on a CPU inductor in a Serve replica (compiled at its start-up) "
        "and none elsewhere (runs too short to earn back the compiling), what measured "
        "fastest (reports/gpu.md, docs/serve.md, reports/compiled_forward.md); none: the fast forward runs eager; "
        "inductor: its layers (norms, projections, RoPE, MLP) as one torch.compile graph with the weights frozen "
        "in, the cache write and attention an eager op a layer, for one-token steps (2+ rows; one row in a graph "
        "of its own, or as a row of 2 in fp32 on CPUs without AMX) and for one row of any tokens (a prompt's "
        "prefill, one sequence's tree, the batch's trees packed side by side; padded to a power of two, then to a "
        "multiple of 16 tokens), each graph compiled on first use (20-40 s for SmolLM2 on 2 cores); step: the "
        "whole decode "
        "step (verify forward, acceptance, the accepted slots' moves) as one graph over the cache's fixed-capacity "
        "buffers, compiled whole (fullgraph) per bucket of batch size, tree width (powers of two) and capacity, "
        "a CUDA graph on a GPU (mode reduce-overhead): one launch per step instead of ~35 per layer; steps it "
        "does not cover (rows with different sampling parameters, another acceptance rule) run eager. Both need a "
        "C++ compiler on a CPU, Triton on a GPU, else the forward runs eager with a log line saying what to "
        "install. Same fp32 tokens as eager; on a CPU inductor's step ran 1.1-1.2x eager's at batch 1-16 in bf16 "
        "(docs/serve.md), step was slower; on an H200 "
        "step ran 2.1x eager at batch 1 and 1.4x at 16 on the 8B shape, after ~40 s of compiling per bucket "
        "(reports/gpu.md; docs/algorithms.md, The cache and the forward)")
    device: Device = Field(
        "auto", description="auto: CUDA when the process was given a GPU (in Ray: its num_gpus), else the CPU; "
        "cuda where none exists is an error. Heads, drafting, verification and training follow the target")
    tiny: TinyTargetConfig | None = None

    @model_validator(mode="after")
    def _tiny_needs_settings(self) -> "TargetConfig":
        if self.name in TINY_TARGETS and self.tiny is None:
            self.tiny = TinyTargetConfig()
        return self


Answers = Literal["dataset", "target"]


class MixtureConfig(_Strict):
    """Training data mixture: corpus -> ratio, a size in conversations, a seed, and whose answers it trains on."""

    mixture: dict[str, float]
    size: int = Field(..., gt=0, description="number of training conversations in total")
    seed: int = 0
    answers: Answers = Field(
        "dataset", description="dataset: the corpora's own answers (the paper's setting); target: every assistant "
        "turn regenerated by the target, greedy, in order (features.regenerate_max_new_tokens), so the head learns "
        "what the target will say (docs/algorithms.md#target-answers)")

    @field_validator("mixture")
    @classmethod
    def _known_positive(cls, value: dict[str, float]) -> dict[str, float]:
        if not value:
            raise ValueError("must name at least one corpus, e.g. {mathinstruct: 0.5, sharegpt: 0.5}")
        return _known_and_positive(value, TRAIN_CORPORA, "corpus", "ratio of")


class FeatureConfig(_Strict):
    max_len: int = Field(512, gt=8, description="tokens per training conversation (longer ones are truncated)")
    batch_size: int = Field(8, gt=0)
    top_k: int = Field(10, gt=0, description="target top-K probabilities stored for the HASS distillation loss")
    regenerate_max_new_tokens: int = Field(
        192, gt=0, description="longest regenerated answer per turn, for mixtures with `answers: target`")
    shard_size: int = Field(64, gt=0, description="conversations per feature shard (a killed run redoes only missing shards)")
    num_workers: int = Field(
        1, gt=0, description="Ray tasks the sweep's features stage splits a set's missing shards over, each holding "
        "the target with `ray.target_*` resources (one per GPU); the shards are the same for any number")

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        if isinstance(data, dict) and "regenerate_answers" in data:
            raise ValueError("features.regenerate_answers is now per mixture: remove it and set `answers: target` "
                             "on each mixture that trains on the target's own answers")
        return data


class TrainConfig(_Strict):
    kinds: list[HeadKind] = Field(
        default_factory=lambda: ["eagle2", "hass"], description="head kinds to train (eagle3 also extracts three "
        "more target layers per token, docs/algorithms.md#eagle-3-heads)")
    mixtures: list[str] = Field(default_factory=lambda: ["math", "chat"])
    compare: dict[str, list[HeadKind]] = Field(
        default_factory=dict, description="extra heads, mixture -> kinds, trained and measured beside the study's "
        "(e.g. dataset-answer twins of target-answer mixtures); each drafts alone under its mixture name, never "
        "inside a combination")
    epochs: int = Field(2, gt=0)
    max_tokens: int | None = Field(None, gt=0, description="stop after this many trained tokens (per head)")
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_ratio: float = Field(0.03, ge=0, lt=1)
    batch_size: int = Field(8, gt=0)
    grad_clip_value: float = Field(0.5, gt=0)
    noise_std: float = Field(0.2, ge=0)
    reg_weight: float = 1.0
    cls_weight: float = 0.1
    topk_weight: float = 1.0
    hca_passes: int = Field(3, ge=1, description="HASS harmonized-context-alignment forward passes (and the "
                            "simulated depths the held-out agreement scores)")
    ttt_steps: int | None = Field(None, ge=1, description="EAGLE-3 training-time-test steps (the head unrolled on "
                                  "its own outputs); None: tree.depth + 1, so every level a tree drafts is trained "
                                  "on the head's own outputs (the reference runs 7)")
    ttt_outside_vocab: Literal["keep", "mask"] = Field(
        "keep", description="EAGLE-3 positions whose target argmax (the stored top-1) lies outside the draft "
        "vocabulary: keep trains them on the target's distribution renormalised on the draft vocabulary; mask drops "
        "them from the loss, as SafeAILab's EAGLE-3 does (docs/algorithms.md#eagle-3-heads)")
    heldout_fraction: float = Field(0.05, gt=0, lt=0.5)
    seed: int = 0
    mask_alignment: Literal["predicted", "ref"] = Field(
        "predicted",
        description="predicted: position t is trained when the token it predicts (x_{t+2}) is an assistant token; "
        "ref: the reference's unshifted mask of x_t (docs/algorithms.md#loss-mask-alignment)",
    )
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="cosine decay floor, as a fraction of lr")
    precision: Literal["fp32", "bf16-mixed", "auto"] = Field(
        "fp32", description="bf16-mixed: forward passes under bfloat16 autocast (backward follows their dtypes), "
        "weights and optimizer in fp32 (about 2x the tokens/s on GPUs and on CPUs with AMX; on an AVX512-BF16 Xeon "
        "without AMX eagle2 trained at 0.45-0.6x fp32's tokens/s, benchmarks/training/train_throughput.py); auto: "
        "bf16-mixed on a GPU or a CPU with AMX, fp32 on other CPUs")
    eval_batch_size: int = Field(8, gt=0)
    shuffle_shards: int = Field(
        4, gt=0, description="feature shards read at once while training: each epoch shuffles the shard order, then "
        "the examples within each group of this many shards; training memory is this many shards, whatever the corpus")


class TreeConfig(_Strict):
    total_token: int = Field(16, gt=1, description="tree size including the root")
    depth: int = Field(4, gt=0)
    top_k: int = Field(4, gt=0)
    draft_vocab_size: int | None = Field(
        None, gt=0, description="draft over the N most frequent training tokens (EAGLE-3 style); None = full vocabulary"
    )
    min_confidence: float = Field(
        0.0, ge=0.0, lt=1.0, description="stop expanding a tree once its best frontier node's cumulative probability "
        "is below this (docs/algorithms.md#draft-confidence-stop); 0 = always draft `depth` levels"
    )

    def updated(self, **fields: Any) -> TreeConfig:
        """This tree with `fields` set, validated as a whole (the shape must fit its top_k and depth)."""
        return TreeConfig.model_validate({**self.model_dump(), **fields})

    def with_shape(self, spec: str) -> TreeConfig:
        """This tree drafting the shape `spec`, "T/D/K" (total_token/depth/top_k; the draft vocabulary and
        min_confidence kept), as a benchmark's `--trees 8/3/2` spells it."""
        try:
            total, depth, top_k = (int(x) for x in spec.split("/"))
        except ValueError:
            raise ValueError(f"tree setting {spec!r} is not total_token/depth/top_k, e.g. 8/3/2") from None
        return self.updated(total_token=total, depth=depth, top_k=top_k)

    @property
    def passes(self) -> int:
        """Head passes a draft runs past the root's children: `depth`, or fewer where the tree's total_token-1
        nodes cannot reach it (a kept node's parent is always kept, so S nodes reach depth S at most and a
        deeper pass's candidates are never selected: a chain of 3 needs 2 passes, not `depth`)."""
        return min(self.depth, self.total_token - 2)

    @model_validator(mode="after")
    def _fits(self) -> "TreeConfig":
        most = self.top_k + self.depth * self.top_k**2
        if self.total_token - 1 > most:
            raise ValueError(
                f"total_token-1={self.total_token - 1} exceeds the {most} candidates that top_k={self.top_k}, "
                f"depth={self.depth} can draft; lower total_token or raise top_k/depth"
            )
        return self


class EvalConfig(_Strict):
    benchmarks: dict[str, int] = Field(
        default_factory=lambda: {b: 10 for b in BENCHMARKS},
        description="benchmark -> number of questions (first N in file order)",
    )
    temperatures: list[float] = Field(default_factory=lambda: [0.0, 1.0])
    max_new_tokens: int = Field(128, gt=0)
    batch_size: int = Field(4, gt=0, description="questions decoded together (one batched target forward per step)")
    proposers: list[str] = Field(default_factory=lambda: ["math", "chat", "confidence-routed", "merged"])
    dtype: DType | None = Field(None, description="overrides target.dtype during evaluation")
    seed: int = 0
    system_prompt: str | None = None
    replay: bool = Field(
        True,
        description="T = 0 cells of draft proposers are replayed from one greedy decode per question, exact and "
        "without a target run per proposer, but with no speed measured; false runs them live",
    )
    replay_batch: int = Field(
        16,
        gt=0,
        description="questions of a replayed cell decoded together (one worker session of this many rows, and its "
        "KV cache, per drafter; sessions merge only up to ray.max_batch rows): it bounds the target worker's replay "
        "KV cache (taps plan)",
    )
    traces_on_host: bool = Field(
        False,
        description="a drafter keeps its benchmark's greedy traces (target features and the trees its heads drafted "
        "along them) in host memory and moves one replay batch at a time to its device; false keeps them all on "
        "the device (taps plan sizes both)",
    )
    live_questions: int | None = Field(
        None,
        gt=0,
        description="questions per benchmark for the cells that run live (T > 0, plain decoding, and every cell "
        "when replay is off), the first N of `benchmarks`; None: as many as `benchmarks`. Replayed cells are cheap "
        "enough for whole benchmarks, live ones pay a target run per proposer",
    )
    live_proposers: list[str] | None = Field(
        None, description="the proposers evaluated at T > 0 (live); None: every one of `proposers`"
    )

    @field_validator("benchmarks")
    @classmethod
    def _known(cls, value: dict[str, int]) -> dict[str, int]:
        return _known_and_positive(value, BENCHMARKS, "benchmark", "question count for")

    @field_validator("temperatures")
    @classmethod
    def _non_negative(cls, value: list[float]) -> list[float]:
        if any(t < 0 for t in value):
            raise ValueError("temperatures must be >= 0 (0 means greedy)")
        return value


class RayConfig(_Strict):
    address: str | None = Field(None, description="None starts a local Ray; 'auto' joins a running cluster")
    num_cpus: int | None = 2
    num_target_workers: int = Field(1, gt=0)
    num_drafters: int = Field(1, gt=0)
    target_num_gpus: float = Field(0.0, ge=0)
    drafter_num_gpus: float = Field(0.0, ge=0)
    trial_cpus: float = Field(1.0, gt=0)
    trial_gpus: float = Field(0.0, ge=0)
    max_batch: int = Field(8, gt=0, description="sequences one target worker verifies in one forward (sessions merge up to this)")
    max_wait_ms: float = Field(5.0, ge=0, description="how long a worker holds submitted trees for other sequences' trees")
    max_cell_retries: int = Field(2, ge=0)
    target_num_cpus: float = Field(1.0, ge=0, description="CPUs Ray reserves per target worker")
    drafter_num_cpus: float = Field(1.0, ge=0, description="CPUs Ray reserves per drafter actor")
    target_resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources per target worker and features task, e.g. "
        "{'accelerator_type:A100': 0.001} to keep them on one kind of GPU node")
    drafter_resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources per drafter actor")
    trial_resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources per training trial, e.g. {'accelerator_type:L40S': "
        "0.001} to keep trials on GPUs with room for them (`taps plan` says which fit)")
    target_memory_gb: float | None = Field(
        None, gt=0, description="host memory (GB = 1e9 bytes) Ray reserves per target worker and features task (None: none declared)")
    drafter_memory_gb: float | None = Field(None, gt=0, description="host memory (GB) Ray reserves per drafter actor")
    trial_memory_gb: float | None = Field(None, gt=0, description="host memory (GB) Ray reserves per training trial")
    torch_threads: int | None = Field(
        None, gt=0, description="torch threads of target workers, drafters and the features task (None: their CPUs)"
    )
    actor_max_restarts: int = Field(3, ge=-1, description="Ray restarts a dead worker or drafter this often (-1: always)")
    session_ttl_s: float = Field(600.0, gt=0, description="a worker drops a sequence group idle for this long")
    storage_path: str | None = Field(
        None, description="Ray Tune storage (None: <work_dir>/tune); shared storage or s3:// on a multi-node cluster"
    )
    max_trial_failures: int = Field(1, ge=0, description="Tune restarts a failed training trial this often")
    worker_niceness: int = Field(
        0, ge=0, le=19, description="nice value of a local Ray's workers (RAY_worker_niceness); Ray's own 15 lets "
        "every other process on the machine, a benchmark client included, preempt a Serve replica's decode")


def memory_bytes(gb: float | None) -> int | None:
    """A `*_memory_gb` setting as Ray's `memory` resource (bytes); None leaves it undeclared."""
    return None if gb is None else int(gb * 1e9)


# the routed models online adaptation can reach inside (one head swapped, a spawned head added): their parts are
# single heads, any number of them
ROUTED_ADAPT = ("routed", "confidence-routed", "learned-routed")


class AdaptConfig(_Strict):
    """`serve.adapt`: the replica records a sampled share of its traffic and a trainer actor beside it keeps
    training the served heads on it, publishing a version only when it agrees better with the target on the most
    recent traffic (docs/serve.md#online-adaptation). Off unless enabled: nothing is recorded or polled."""

    enabled: bool = Field(False, description="record traffic, train beside serving and swap in better head versions")
    models: list[str] = Field(default_factory=list, description="the models that adapt: single-head models (mixture "
                              "names) and routed ones (ROUTED_ADAPT: each of their heads adapts on the traffic routed "
                              "to it); empty: every served single head")
    sample: float = Field(0.25, gt=0, le=1, description="share of a model's requests whose features are recorded")
    max_recorded_per_minute: int = Field(60, gt=0, description="at most this many requests recorded per minute and "
                                         "replica (the recorder's bounded rate)")
    buffer_tokens: int = Field(200_000, gt=0, description="positions a model's buffer keeps; the oldest shards age out")
    max_age_s: float | None = Field(3600.0, gt=0, description="shards older than this age out (None: by size only)")
    flush_tokens: int = Field(1024, gt=0, description="recorded positions gathered before one buffer shard is written")
    heldout_fraction: float = Field(0.25, gt=0, lt=1, description="newest share of the buffer held out to score versions")
    min_new_tokens: int = Field(512, gt=0, description="positions recorded since the last round before a round trains")
    steps_per_round: int = Field(40, gt=0, description="optimizer steps of one training round")
    batch_size: int = Field(4, gt=0, description="recorded sequences per training step")
    lr: float = Field(2e-4, gt=0, description="AdamW learning rate of online training (constant)")
    precision: Literal["fp32", "bf16-mixed", "auto"] | None = Field(
        None, description="online training's forward precision; None: train.precision (a CPU without AMX trains "
        "faster in fp32)")
    min_gain: float = Field(0.0, ge=0, description="held-out agreement a candidate must beat the served version by")
    poll_s: float = Field(2.0, gt=0, description="how often a replica looks for a published version, between steps")
    rollback_requests: int = Field(16, gt=0, description="finished requests per version before live acceptance is "
                                   "compared; fewer: no rollback")
    rollback_margin: float = Field(0.05, ge=0, description="roll back when the new version's live tau is below the "
                                   "previous one's by more than this (tau over a few requests is noisy)")
    trainer_num_cpus: float = Field(1.0, gt=0, description="CPUs Ray reserves for the trainer actor (its torch threads)")
    trainer_duty: float = Field(
        1.0, gt=0, le=1, description="the most share of time the trainer trains: after each optimizer step it rests "
        "for the step's time x (1 / duty - 1). 1: back to back (a trainer on its own GPU or node); below 1 where it "
        "shares a host with replicas, which then lose about duty x the back-to-back cost (benchmarks/serving/"
        "online_adapt.py measures both)")
    dir: str = Field("adapt", description="versions and buffers, under work_dir")
    spawn: bool = Field(False, description="new heads for new traffic: when a routed model's recent requests keep "
                        "decoding below `spawn_below_tau` on every head, fork a new head from the closest one, train "
                        "it on those requests and add it to the routed model (docs/serve.md#spawning-heads)")
    spawn_below_tau: float = Field(1.5, gt=1, description="a finished request is low when its tau (tokens per "
                                   "verification step) is below this")
    spawn_window: int = Field(32, gt=0, description="the recent finished requests of a routed model the rule looks at")
    spawn_after: int = Field(16, gt=0, description="low requests in the window (at most spawn_window) before a spawn "
                             "is asked for")
    max_heads: int = Field(4, ge=2, description="the most heads a routed model grows to, spawned heads included")

    @model_validator(mode="after")
    def _spawn_settings(self) -> AdaptConfig:
        if self.spawn_after > self.spawn_window:
            raise ValueError(f"serve.adapt.spawn_after ({self.spawn_after}) counts low requests within the last "
                             f"spawn_window ({self.spawn_window}) requests, so it cannot exceed it")
        if self.spawn and not any(m in ROUTED_ADAPT for m in self.models):
            raise ValueError("serve.adapt.spawn adds heads to a routed model: list one of "
                             f"{', '.join(ROUTED_ADAPT)} in serve.adapt.models")
        return self


class ServedTree(_Strict):
    """The fields of the study's `tree` that `taps serve` drafts with instead (each None: the study's). The heads
    and the draft vocabulary stay the study's; only the shape a served head drafts changes."""

    total_token: int | None = Field(None, gt=1)
    depth: int | None = Field(None, gt=0)
    top_k: int | None = Field(None, gt=0)
    min_confidence: float | None = Field(None, ge=0.0, lt=1.0)

    def over(self, tree: TreeConfig) -> TreeConfig:
        """`tree` with these fields set."""
        return tree.updated(**self.model_dump(exclude_none=True))


class ServeConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, gt=0, lt=65536)
    num_replicas: int = Field(1, gt=0)
    max_batch_size: int = Field(4, gt=0)
    max_prompt_tokens: int = Field(1024, gt=0)
    max_tokens_limit: int = Field(512, gt=0)
    default_max_tokens: int = Field(128, gt=0, description="max_tokens of a request that sets none (capped by max_tokens_limit)")
    head_kind: HeadKind = Field("eagle2", description="which trained heads the service loads (<work_dir>/heads/<kind>-<mixture>)")
    max_ongoing_requests: int = Field(32, gt=0, description="requests one replica holds at once (queued + decoding)")
    replica_num_cpus: float = Field(1.0, gt=0, description="CPUs Ray reserves per replica (also its torch threads)")
    replica_omp_wait: Literal["default", "passive", "active"] = Field(
        "default", description="how a replica's idle OpenMP threads wait between kernels (CPU targets): `default`, "
        "OpenMP's own (libgomp spins about 3 ms, then sleeps; GOMP_SPINCOUNT=300000 in the replica, because Ray's "
        "workers inherit the project's OMP_WAIT_POLICY=PASSIVE); `passive`, they sleep at once (replicas sharing "
        "their cores with other CPU work); `active`, they spin for minutes. A decode step is hundreds of small "
        "kernels: with 2 threads `default` measured 1.3-2.2x faster than `passive`, and faster than 1 thread at "
        "batch 1 and 16 (reports/decode_threads.md)")
    replica_num_gpus: float = Field(0.0, ge=0, description="GPUs Ray reserves per replica (target.device auto then uses it)")
    replica_memory_gb: float | None = Field(None, gt=0, description="host memory (GB) Ray reserves per replica (None: none declared)")
    replica_resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources per replica")
    draft_below: int | None = Field(
        None, gt=0, description="draft only while fewer requests than this decode in one batch; larger batches decode "
        "plainly (lossless either way). None: no cap. Speculation pays while the target's forward is memory-bound: "
        "small batches on a GPU; on a CPU only batch 1 (`benchmarks/serving/serve_load.py` measures it)")
    measure_drafting: bool = Field(
        True, description="below `draft_below`, a batch drafts only where drafting measures faster at its size: per "
        "batch-size bucket (1, 2, 3-4, 5-8, ...) the replica keeps the recent committed tokens per second of "
        "drafted and of undrafted steps, runs the faster and re-measures the other every 32nd step, backing off to "
        "every 256th while the probes confirm the choice (decoding/draft_gate.py); false: every batch below the cap "
        "drafts")
    prefill_tokens: int | None = Field(
        128, gt=0, description="the most prompt tokens one scheduling iteration prefills (at least one request "
        "joins), so a flood of joining requests is admitted over several steps and the first of them start "
        "decoding while the rest are prefilled (vLLM's per-step token budget, at request granularity); beside a "
        "running batch the joining prompts are prefilled inside its verification step's forward (taps' fast "
        "forward), otherwise first, in groups of similar lengths (docs/serve.md#batching). 128 on a 2-core CPU, "
        "about one chat prompt a step: a step that takes in a prompt costs its prefill (65-110 ms against a plain "
        "step's 21-30 ms, bf16), so requests that arrive together get their first tokens a step apart instead of "
        "all after one long step; served against 512, p50 TTFT fell 21-59% at 4 and 16 in flight for 0-11% less "
        "throughput at 16 (docs/serve.md#batching). A GPU, where a prefill of 2048 tokens costs little more than "
        "one of 512, takes a larger budget. None: admit every request that fits the batch at once")
    cost_model: bool = Field(
        True, description="every drafting model runs under the per-sequence cost model (`auto-<name>`, "
        "docs/algorithms.md#cost-model): a sequence drafts only while its measured drafting and verification pay "
        "for the tokens they commit, so a weak head decoding alone pays for itself; it does not see the batch (a "
        "drafted tree widens every row's forward: `measure_drafting` and `draft_below` decide for the batch); false serves the proposers as they "
        "are (to measure them raw)")
    max_queued_requests: int = Field(
        64, gt=0, description="requests one replica holds waiting to join the running batch; beyond it: 503 + Retry-After")
    stall_timeout_s: float = Field(
        300.0, gt=0, description="check_health fails when the decode loop has work but finished no step for this long")
    autoscaling_config: dict[str, Any] | None = Field(
        None, description="Ray Serve autoscaling_config of the deployment (min_replicas, max_replicas, "
        "target_ongoing_requests, ...); replaces num_replicas when set")
    listener: Literal["proxy", "replica"] = Field(
        "proxy", description="who answers HTTP on host:port. `proxy`: Ray Serve's HTTP proxy, which routes across "
        "replicas and nodes. `replica`: the one replica itself (serve/listener.py), and `taps serve` starts no "
        "Serve proxy: each decode step's streamed chunks leave from the replica's event loop instead of one Ray "
        "message per token and request, whose wakeups slowed a CPU replica's step by 13-16% (docs/serve.md); "
        "one replica only")
    tree: ServedTree = Field(
        default_factory=ServedTree, description="the tree shape the served heads draft, over the study's `tree` "
        "(unset fields: the study's). On a CPU a small target's step costs about as much as drafting a 16-node, "
        "depth-4 tree, so a short chain serves faster at few sequences: {total_token: 4, depth: 3, top_k: 1}, vLLM's "
        "3 speculative tokens (docs/serve.md#the-served-tree)")
    draft_dtype: DType | Literal["auto"] | None = Field(
        None, description="the dtype the served heads draft in, with the target's LM head rows they read (None: the "
        "target's; `auto`: bfloat16 under a float32 target on a CPU that multiplies bf16 natively, AVX512-BF16 or "
        "AMX, else the target's). A draft pass reads the head and its LM head rows from memory, so bfloat16 halves "
        "that. The target still verifies in its own dtype: outputs are unchanged, only which drafts are accepted "
        "may differ (docs/serve.md#the-draft-dtype)")
    adapt: AdaptConfig = AdaptConfig()

    @model_validator(mode="after")
    def _one_replica_listens(self) -> ServeConfig:
        if self.listener == "replica" and (self.num_replicas > 1 or self.autoscaling_config):
            raise ValueError("serve.listener=replica serves one replica on host:port; with num_replicas > 1 or an "
                             "autoscaling_config use serve.listener=proxy (Ray Serve's proxy routes across them)")
        return self


class SearchConfig(_Strict):
    """`taps search`: Ray Tune samples the math/chat ratio (and size) of a training mixture, ASHA stops the trials
    whose held-out agreement, averaged over `heldout`, trails; the best trial's head becomes the `searched` head."""

    kind: HeadKind = Field("eagle2", description="the head kind every trial trains (and the searched head is)")
    math_ratio: tuple[float, float] = Field(
        (0.1, 0.9), description="range of the mathinstruct share of a trial's mixture; sharegpt gets the rest")
    ratio_step: float = Field(
        0.05, gt=0, le=1, description="ratios are sampled on this grid, so trials drawing one ratio share features")
    sizes: list[int] = Field(
        default_factory=list, description="mixture sizes (conversations) to sample from; empty: the smallest size "
        "of the `heldout` mixtures, whose features then cover every trial's conversations")
    seed: int = Field(0, description="mixture seed of every trial; equal to the `heldout` mixtures' seed, their "
                      "features are copied into a trial's set instead of being recomputed")
    num_samples: int = Field(8, gt=0, description="trials Tune samples")
    max_epochs: int | None = Field(None, gt=0, description="epochs a trial may train (ASHA max_t); None: train.epochs")
    max_tokens: int | None = Field(None, gt=0, description="trained-token budget of a trial; None: train.max_tokens")
    grace_period: int = Field(1, gt=0, description="ASHA: epochs every trial trains before it can be stopped")
    reduction_factor: int = Field(2, ge=2, description="ASHA: 1/this of the trials at a rung continue")
    heldout: list[str] = Field(
        default_factory=lambda: ["math", "chat"], description="mixtures whose held-out conversations score every "
        "epoch; a trial's metric `agreement` is the mean of their top-1 agreements")
    max_concurrent_trials: int | None = Field(None, gt=0, description="None: as many as `ray.trial_*` resources allow")

    @field_validator("math_ratio")
    @classmethod
    def _ratio_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        low, high = value
        if not 0 <= low <= high <= 1:
            raise ValueError(f"needs 0 <= low <= high <= 1, got [{low}, {high}]")
        return value

    @field_validator("sizes")
    @classmethod
    def _positive(cls, value: list[int]) -> list[int]:
        if any(size <= 0 for size in value):
            raise ValueError(f"sizes must be > 0, got {value}")
        return value


class StudyConfig(_Strict):
    name: str
    target: TargetConfig = TargetConfig()
    data_dir: str | None = Field(None, description="local data directory; TAPS_DATA_DIR overrides when set")
    mixtures: dict[str, MixtureConfig]
    features: FeatureConfig = FeatureConfig()
    train: TrainConfig = TrainConfig()
    tree: TreeConfig = TreeConfig()
    eval: EvalConfig = EvalConfig()
    ray: RayConfig = RayConfig()
    serve: ServeConfig = ServeConfig()
    search: SearchConfig = SearchConfig()
    work_dir: str = Field("runs/default", description="features, checkpoints and the results store live here")
    reports_dir: str = "reports"

    @model_validator(mode="after")
    def _mixtures_exist(self) -> "StudyConfig":
        missing = [m for m in self.train.mixtures if m not in self.mixtures]
        if missing:
            raise ValueError(
                f"train.mixtures names {missing} but mixtures defines only {sorted(self.mixtures)}; "
                "add them under mixtures: or remove them from train.mixtures"
            )
        unknown = [m for m in self.train.compare if m not in self.mixtures]
        if unknown:
            raise ValueError(f"train.compare names {unknown} but mixtures defines only {sorted(self.mixtures)}")
        both = [m for m in self.train.compare if m in self.train.mixtures]
        if both:
            raise ValueError(f"train.compare names {both}, which train.mixtures trains already; list each mixture once")
        return self

    @model_validator(mode="after")
    def _served_tree_fits(self) -> "StudyConfig":
        try:
            self.serve.tree.over(self.tree)
        except ValidationError as error:
            problems = "; ".join(item["msg"].removeprefix("Value error, ") for item in error.errors())
            raise ValueError(f"serve.tree over the study's tree: {problems}") from None
        return self

    def served(self) -> "StudyConfig":
        """This config as `taps serve` drafts: `tree` with `serve.tree`'s fields set."""
        return self.model_copy(update={"tree": self.serve.tree.over(self.tree)})

    def head_pairs(self) -> list[tuple[str, str]]:
        """(kind, mixture) of every head the study trains: train.kinds x train.mixtures, then train.compare's."""
        study = [(kind, mixture) for mixture in self.train.mixtures for kind in self.train.kinds]
        return [*study, *((kind, mixture) for mixture, kinds in self.train.compare.items() for kind in kinds)]

    def head_mixtures(self, kind: str | None = None) -> list[str]:
        """The mixtures with heads to load: train.mixtures in order, then those of train.compare that train a
        `kind` head (all of them when `kind` is None)."""
        compare = [m for m, kinds in self.train.compare.items() if kind is None or kind in kinds]
        return [*self.train.mixtures, *compare]

    def resolved_data_dir(self) -> Path | None:
        """TAPS_DATA_DIR (which a --data-dir flag sets, see `with_overrides`) over the YAML's data_dir."""
        value = os.environ.get(DATA_DIR_ENV) or self.data_dir
        return Path(value).expanduser() if value else None

    def work_path(self, *parts: str) -> Path:
        return Path(self.work_dir).expanduser().joinpath(*parts)


def _describe(error: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for item in error.errors():
        where = ".".join(str(p) for p in item["loc"]) or "(top level)"
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown field; check its spelling or remove it"
        elif item["type"] == "missing":
            message = "required field is missing"
        lines.append(f"  {where}: {message}")
    return "\n".join(lines)


def parse_config(data: dict, source: str = "<dict>") -> StudyConfig:
    try:
        return StudyConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(_describe(error, source)) from None


def read_yaml_mapping(path: Path, label: str, error: type[Exception], missing_hint: str, keys: str) -> dict:
    """The YAML mapping at `path`, or `error` with the one line that says what is wrong with the file: missing,
    not YAML (at which line), or not a mapping (`keys`: what its keys should be and where to see some). The study
    config and the Ray cluster file are read alike; `label` names which one ("config file")."""
    if not path.is_file():
        raise error(f"{label} {path} not found; {missing_hint}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as problem:
        where = getattr(problem, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        raise error(f"{label} {path} is not valid YAML{line}; fix its syntax") from None
    if not isinstance(data, dict):
        got = "empty" if data is None else f"a {type(data).__name__}"
        raise error(f"{label} {path} is {got}, not a mapping of {keys}")
    return data


def load_config(path: str | os.PathLike) -> StudyConfig:
    path = Path(path)
    data = read_yaml_mapping(path, "config file", ConfigError, "pass one of the files in configs/ (e.g. configs/cpu.yaml)",
                             "study config fields; see configs/cpu.yaml")
    return parse_config(data, str(path))


def with_overrides(cfg: StudyConfig, *, data_dir: str | None = None, work_dir: str | None = None,
                   reports_dir: str | None = None) -> StudyConfig:
    """The one place command-line values override a loaded config (None keeps the config's value).

    The data folder's precedence is: the flag, then TAPS_DATA_DIR, then the YAML's data_dir. A flag is also
    written to TAPS_DATA_DIR, so the data loaders and every process started later (Ray actors, Tune trials)
    see the same folder.
    """
    if data_dir:
        os.environ[DATA_DIR_ENV] = data_dir
    update = {"data_dir": data_dir, "work_dir": work_dir, "reports_dir": reports_dir}
    update = {key: value for key, value in update.items() if value}
    return cfg.model_copy(update=update) if update else cfg
