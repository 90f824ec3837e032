"""Ray actors around the engine; thin on purpose: decoding is `taps_ray.decoding`, batching its `verification_pool`.

* `TargetWorker` (async actor): holds the target and a `VerificationPool` of sessions; drafters call
  `start` / `step` / `close` on it, and it verifies the trees of many sessions in one batched forward.
* `DrafterActor`: holds the draft heads (shipped by the driver, so it needs no shared disk) and the
  target's embeddings and LM head (the draft context, read alone from the target's weights by
  `models.draft_parts`: a drafter never loads the target's layers); it runs `eval.runner.run_cell` with a
  `WorkerVerifier` — the engine's `Verifier` seam — that forwards start/step to its target worker. The
  loop, the proposers and the acceptance rule are the in-process ones, so tokens are the same.

Each process computes on its own device (`models.device.resolve_device`: the GPU Ray granted it, else the
CPU); what crosses between them (trees in, `Committed` out) travels as CPU tensors, so a CPU drafter can
talk to a GPU worker, and each side moves what it receives to its own device.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

import psutil
import ray
import torch

from taps_ray.compute_thread import compute_executor
from taps_ray.config import StudyConfig, parse_config
from taps_ray.decoding.target_batch import Committed, results_to
from taps_ray.decoding.verification_pool import VerificationPool
from taps_ray.decoding.verify import SamplingParams
from taps_ray.drafting.setup import head_names, load_heads
from taps_ray.drafting.tree import DraftTree, trees_to
from taps_ray.eval.cell import NO_HEAD, Cell
from taps_ray.eval.runner import TraceCache, eval_dtype, is_replayed, run_cell
from taps_ray.models.draft_head import DraftHead
from taps_ray.models.draft_parts import load_draft_target
from taps_ray.models.target import load_target
from taps_ray.ray_runtime import prepare_process
from taps_ray.workdir import head_checkpoint


def _config(payload: str) -> StudyConfig:
    return parse_config(json.loads(payload), "<driver>")


# --- heads travel through the object store ------------------------------------------------------------------


def pack_heads(config: StudyConfig, kinds: list[str]) -> dict[str, dict[str, dict[str, bytes]]]:
    """kind -> mixture -> {file name: bytes} of every trained head the evaluation needs."""
    packed: dict[str, dict[str, dict[str, bytes]]] = {}
    for kind in kinds:
        packed[kind] = {}
        for mixture in head_names(config, kind):
            folder = head_checkpoint(config, kind, mixture)
            if folder.is_dir():
                packed[kind][mixture] = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
    return packed


def unpack_heads(config: StudyConfig, kind: str, packed: dict, dtype: torch.dtype, device: torch.device) -> dict:
    """The shipped heads of `kind`, loaded from their bytes. Nothing is written to disk: the actor's scratch folder
    for them outlived it whenever Ray killed it (a killed process runs no finaliser), and every sweep left its
    heads' copies in the node's /tmp."""
    files = packed.get(kind)
    if not files:  # nothing shipped: read the (shared) work dir, as the in-process path does
        return load_heads(config, kind, dtype, device=device)
    missing = [m for m in config.head_mixtures(kind) if m not in files]
    if missing:
        raise FileNotFoundError(f"no trained {kind} head for mixtures {missing}; run the train stage first")
    heads = {}
    for mixture in files:  # train.mixtures, then the searched head when one was shipped
        heads[mixture] = DraftHead.from_files(files[mixture], dtype=dtype, device=device).eval()
    return heads


# --- the verifier proxy ---------------------------------------------------------------------------------------


class WorkerVerifier:
    """The engine's `Verifier`, backed by a session on a `TargetWorker`. Trees and results cross as CPU tensors,
    moved a batch at a time (`trees_to`, `results_to`); results arrive on `device`, where the drafter drafts."""

    def __init__(self, worker: Any, owner: str, feature_layers: tuple[int, ...] = (),
                 device: torch.device | str = "cpu") -> None:
        self.worker = worker
        self.owner = owner
        self.feature_layers = feature_layers
        self.device = torch.device(device)
        self.sid: str | None = None

    def start(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int]) -> list[Committed]:
        self.sid, committed = ray.get(
            self.worker.start.remote(prompts, params, seeds, self.owner, self.feature_layers))
        return results_to(committed, self.device)

    def step(self, trees: list[DraftTree | None]) -> list[Committed | None]:
        return results_to(ray.get(self.worker.step.remote(self.sid, trees_to(trees, "cpu"))), self.device)

    def close(self, quiet: bool = False) -> None:
        if self.sid is None:
            return
        sid, self.sid = self.sid, None
        try:
            ray.get(self.worker.close.remote(sid))
        except Exception:
            if not quiet:
                raise


def memory_use() -> dict[str, int]:
    """This process's memory in bytes (`benchmarks/memory/memory.py` compares actors): `rss`, every resident page it
    maps; `uss`, the pages only it holds (what ending it frees); `pss`, shared pages split among their users."""
    info = psutil.Process().memory_full_info()
    return {"rss": int(info.rss), "uss": int(info.uss), "pss": int(info.pss)}


# --- actors -------------------------------------------------------------------------------------------------


@ray.remote
class TargetWorker:
    """The target model plus per-session KV caches; verifies drafters' trees in batched forwards."""

    def __init__(self, payload: str) -> None:
        config = _config(payload)
        self.threads = prepare_process(config.ray.torch_threads, config.ray.target_num_cpus)
        compute = compute_executor("verify", self.threads)  # the pool's thread loads the target too (why: there)
        self.target = compute.submit(load_target, config.target, dtype=config.eval.dtype).result()
        r = config.ray
        self.pool = VerificationPool(self.target.model, r.max_batch, r.max_wait_ms, r.session_ttl_s, executor=compute)
        self.started = time.time()

    async def start(self, prompts, params, seeds, owner: str = "", feature_layers: tuple[int, ...] = ()
                    ) -> tuple[str, list[Committed]]:
        sid, committed = await self.pool.start(prompts, params, seeds, owner, feature_layers)
        return sid, results_to(committed, "cpu")

    async def step(self, sid: str, trees: list) -> list:
        return results_to(await self.pool.step(sid, trees), "cpu")

    async def close(self, sid: str) -> None:
        await self.pool.close(sid)

    async def drop_owner(self, owner: str) -> int:
        return await self.pool.drop_owner(owner)

    async def stats(self) -> dict:
        return {**self.pool.describe(), "threads": self.threads, "pid": os.getpid(), "node": socket.gethostname()}

    async def ping(self) -> int:
        return os.getpid()

    async def memory(self) -> dict[str, int]:
        return memory_use()


@ray.remote
class DrafterActor:
    """Draft heads + the draft side of the loop; evaluates whole cells against its target worker."""

    def __init__(self, payload: str, worker: Any, name: str, heads: dict) -> None:
        self.config = _config(payload)
        self.threads = prepare_process(self.config.ray.torch_threads, self.config.ray.drafter_num_cpus)
        self.worker = worker
        self.name = name
        self.packed = heads
        self.traces = None  # eval.runner.TraceCache, made on the first cell: replayed cells share greedy decodes
        self.heads: dict[str, dict] = {}
        self.target = load_draft_target(self.config.target, dtype=self.config.eval.dtype)
        try:  # a restarted drafter clears the sessions its previous life left on the worker
            ray.get(self.worker.drop_owner.remote(self.name), timeout=600)
        except Exception:
            pass

    def _heads(self, kind: str) -> dict:
        """The heads of one kind on the device; another kind's leave first (and the trees they drafted along the
        traces with them): one kind's heads, not every kind's, is what the drafter's GPU share is sized for
        (`taps plan`)."""
        if kind not in self.heads:
            self.heads.clear()
            self.heads[kind] = unpack_heads(
                self.config, kind, self.packed, eval_dtype(self.config), self.target.device
            )
        return self.heads[kind]

    def run_cell(self, cell: dict) -> tuple[list[dict], list[dict], dict]:
        """One cell through the worker: (steps, questions, info), the records exactly as `run_cell` returns them
        in-process."""
        the_cell = Cell(**cell)
        heads = {} if the_cell.head_kind == NO_HEAD else self._heads(the_cell.head_kind)
        sessions: list[WorkerVerifier] = []

        def verifier(layers: tuple[int, ...]) -> WorkerVerifier:
            if sessions:  # run_cell asks for a verifier per batch; the previous batch is finished
                sessions[-1].close()
            sessions.append(WorkerVerifier(self.worker, self.name, layers, self.target.device))
            return sessions[-1]

        start = time.perf_counter()
        try:
            self.traces = self.traces or TraceCache()
            steps, questions = run_cell(
                self.config, the_cell, self.target, heads, verifier_factory=verifier, traces=self.traces
            )
        finally:
            if sessions:
                sessions[-1].close(quiet=True)
        info = {
            "seconds": time.perf_counter() - start,
            "tokens": sum(q["n_tokens"] for q in questions),
            "drafter": self.name,
            "node": socket.gethostname(),
            "path": "ray",
            "replayed": is_replayed(self.config, the_cell),
        }
        return steps, questions, info

    def ping(self) -> int:
        return os.getpid()

    def memory(self) -> dict[str, int]:
        return memory_use()
