"""Prometheus metrics of the Serve app, through `ray.util.metrics` (exported by every Ray node's metrics agent).

Names carry the `taps_serve_` prefix (Ray adds `ray_` on export). docs/serve.md lists them and how to see them.
Created once per replica process, on first use: `ray.util.metrics` needs a connected Ray worker.
"""

from __future__ import annotations

from functools import lru_cache

from ray.util.metrics import Counter, Gauge, Histogram

from taps_ray.decoding.draft_gate import StepRate, bucket_label

LATENCY_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]
TAU = [1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0]
COUNTS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


class ServeMetrics:
    """Every metric of one replica; methods take plain values so callers need not know the metric types."""

    def __init__(self) -> None:
        self.requests = Counter("taps_serve_requests", "HTTP requests answered, by model and status code",
                                tag_keys=("model", "status"))
        self.queue_depth = Gauge("taps_serve_queue_depth", "requests waiting to join the running batch")
        self.batch_size = Histogram("taps_serve_batch_size", "sequences verified together per decode step",
                                    boundaries=[1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64])
        self.live = Gauge("taps_serve_running_sequences", "sequences in the running batch")
        self.tokens = Counter("taps_serve_tokens", "tokens, by model and kind (prompt, completion)",
                              tag_keys=("model", "kind"))
        self.tau = Histogram("taps_serve_tau", "tokens per verification step of a finished request", boundaries=TAU,
                             tag_keys=("model",))
        self.accepted = Histogram("taps_serve_accepted_tokens", "drafted tokens the target accepted per request",
                                  boundaries=COUNTS, tag_keys=("model",))
        self.head_steps = Counter("taps_serve_head_steps", "verification steps by the head whose tree was verified "
                                  "(merged, none = drafting paused); fractions are ratios of rates",
                                  tag_keys=("model", "head"))
        self.ttft = Histogram("taps_serve_time_to_first_token_s", "seconds from arrival to the first token",
                              boundaries=LATENCY_S, tag_keys=("model",))
        self.itl = Histogram("taps_serve_inter_token_latency_s", "seconds between a request's decode steps divided "
                             "by the tokens the step added", boundaries=LATENCY_S, tag_keys=("model",))
        self.step_rate = Gauge("taps_serve_step_tokens_per_s", "the drafting gate's recent committed tokens per "
                               "second of drafted and undrafted steps, by batch-size bucket",
                               tag_keys=("batch", "drafted"))
        self.e2e = Histogram("taps_serve_request_latency_s", "seconds from arrival to the last token",
                             boundaries=LATENCY_S, tag_keys=("model",))
        # online adaptation (serve.adapt, docs/serve.md#online-adaptation): per model and head version
        version = ("model", "version")
        self.version_tau = Histogram("taps_serve_adapt_tau", "tokens per verification step of a finished request, "
                                     "by head version", boundaries=TAU, tag_keys=version)
        self.version_live_tau = Gauge("taps_serve_adapt_live_tau", "pooled tau of the version's finished requests on "
                                      "this replica (what rollback compares)", tag_keys=version)
        self.version_accepted = Counter("taps_serve_adapt_accepted_tokens", "drafted tokens accepted, by head version",
                                        tag_keys=version)
        self.version_drafted = Counter("taps_serve_adapt_drafted_tokens", "drafted tokens verified, by head version "
                                       "(accepted / drafted: the version's acceptance rate)", tag_keys=version)
        self.version_tokens = Counter("taps_serve_adapt_completion_tokens", "completion tokens by head version (its "
                                      "rate: tokens/s)", tag_keys=version)
        self.swaps = Counter("taps_serve_adapt_swaps", "head versions a replica switched to (kind: publish, rollback)",
                             tag_keys=("model", "kind"))
        self.served_version = Gauge("taps_serve_adapt_version", "the head version a model serves", tag_keys=("model",))
        self.buffer_tokens = Gauge("taps_serve_adapt_buffer_tokens", "positions in the model's traffic buffer",
                                   tag_keys=("model",))
        # a routed model's heads (docs/serve.md#spawning-heads): versions per head, spawned heads
        self.head_swaps = Counter("taps_serve_adapt_head_swaps", "head versions a routed model switched to, by head "
                                  "(kind: publish, rollback, spawn)", tag_keys=("model", "head", "kind"))
        self.head_version = Gauge("taps_serve_adapt_head_version", "the version each head of a routed model serves",
                                  tag_keys=("model", "head"))
        self.heads_spawned = Counter("taps_serve_adapt_heads_spawned", "heads spawned into a routed model and added "
                                     "on this replica", tag_keys=("model",))

    def request(self, model: str, status: int) -> None:
        self.requests.inc(tags={"model": model, "status": str(status)})

    def step(self, live: int, waiting: int) -> None:
        if live:
            self.batch_size.observe(live)
        self.live.set(live)
        self.queue_depth.set(waiting)

    def gate_rates(self, rates: dict[tuple[int, bool], StepRate]) -> None:
        for (key, drafted), rate in rates.items():
            self.step_rate.set(rate.tokens_per_s, tags={"batch": bucket_label(key), "drafted": str(drafted).lower()})

    def first_token(self, model: str, seconds: float) -> None:
        self.ttft.observe(seconds, tags={"model": model})

    def tokens_added(self, model: str, count: int, seconds: float) -> None:
        """A later step of one request added `count` tokens `seconds` after its previous one."""
        self.itl.observe(seconds / max(count, 1), tags={"model": model})

    def finished(self, model: str, prompt: int, completion: int, tau: float, accepted: int,
                 head_steps: dict[str, int], seconds: float) -> None:
        self.tokens.inc(prompt, tags={"model": model, "kind": "prompt"})
        if completion:
            self.tokens.inc(completion, tags={"model": model, "kind": "completion"})
        self.tau.observe(tau, tags={"model": model})
        self.accepted.observe(accepted, tags={"model": model})
        for head, steps in head_steps.items():
            self.head_steps.inc(steps, tags={"model": model, "head": head})
        self.e2e.observe(seconds, tags={"model": model})

    def version_finished(self, model: str, version: int, tau: float, accepted: int, drafted: int, completion: int,
                         live_tau: float, buffer_tokens: int) -> None:
        """A request drafted by head `version` of `model` finished."""
        tags = {"model": model, "version": str(version)}
        self.version_tau.observe(tau, tags=tags)
        self.version_live_tau.set(live_tau, tags=tags)
        for counter, value in ((self.version_accepted, accepted), (self.version_drafted, drafted),
                               (self.version_tokens, completion)):
            if value:
                counter.inc(value, tags=tags)
        self.buffer_tokens.set(buffer_tokens, tags={"model": model})

    def swapped(self, model: str, version: int, kind: str) -> None:
        self.swaps.inc(tags={"model": model, "kind": kind})
        self.served_version.set(version, tags={"model": model})

    def head_swapped(self, model: str, head: str, version: int, kind: str) -> None:
        """Head `head` of routed `model` serves `version` now (kind spawn: a new head, version 0)."""
        self.head_swaps.inc(tags={"model": model, "head": head, "kind": kind})
        self.head_version.set(version, tags={"model": model, "head": head})
        if kind == "spawn":
            self.heads_spawned.inc(tags={"model": model})


@lru_cache(maxsize=1)
def serve_metrics() -> ServeMetrics:
    return ServeMetrics()
