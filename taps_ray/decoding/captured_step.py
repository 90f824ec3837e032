"""The decode step as one captured graph (`target.compile: step`): the verify forward, the acceptance and the
commit of the accepted slots, over the cache's fixed-capacity buffers, compiled whole per shape bucket.

Why: eager, a step on the Llama-3-8B shape launches ~35 kernels a layer from Python, and the host, not the
device, sets the pace (benchmarks/speed/host_overhead.py counts them). Captured, the host pads the trees to the
bucket, launches one graph and reads one small tensor back (the accepted paths); on CUDA the graph is a CUDA
graph (`mode="reduce-overhead"`), replayed with one launch.

What makes it capturable:
* shapes bucketed: the batch and the tree width rounded up to powers of two (padding rows carry no tree and
  move nothing; padding nodes attend only themselves), the cache's capacity as `KVCache.reserve` grew it
  (doubling, so a logarithmic number of graphs), every size static (`dynamic=False`): one graph per bucket, no
  recompile within it;
* no Python integer that changes every step: the committed width is a tensor, new keys and values are written
  with `index_copy_` at `width + node`, attention runs over the whole capacity with one additive mask built in
  the graph (the committed slots of each row, then its tree's ancestors);
* no host read inside: the acceptance (`verify.packed_paths`) and the slot moves (`kv_cache.move_slots`) are
  device ops; the host reads the packed paths after the graph, as the eager step does once.
It covers the point-mass acceptance with one `SamplingParams` for the whole batch and targets without a
sliding window narrower than the cache (windowed attention over a fixed capacity is not written); any other
step runs eager (`TargetBatch._step`). The cache buffers and the weights are static addresses for CUDA graphs
(`mark_static_address`): the graph writes the former in place and would otherwise copy both in at every replay.
"""

from __future__ import annotations

import torch

from taps_ray.decoding.verify import SamplingParams, packed_paths, shared_choices
from taps_ray.drafting.tree import tree_structure
from taps_ray.models.fast_llama import FastLlama
from taps_ray.models.kv_cache import move_slots

RECOMPILE_LIMIT = 64  # graphs per compiled function: buckets of batch, tree width and capacity, by sampling kind


def bucket(size: int) -> int:
    """The bucket of a batch size or tree width: the next power of two."""
    return 1 << max(size - 1, 0).bit_length()


class StepGraph:
    """The captured step of one forward, for batches sharing `params`, `feature_layers` and `keep_logits`; `compiled`
    False runs the same function eager (what tests compare the graph with, and benchmarks count ops in)."""

    def __init__(self, forward: FastLlama, params: SamplingParams, feature_layers: tuple[int, ...],
                 keep_logits: bool, compiled: bool) -> None:
        self.forward, self.params = forward, params
        self.feature_layers, self.keep_logits = feature_layers, keep_logits
        self.run = self.step
        self.cuda_graphs = compiled and forward.embed.device.type == "cuda"
        if compiled:
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
            self.run = torch.compile(self.step, fullgraph=True, dynamic=False,
                                     mode="reduce-overhead" if self.cuda_graphs else None)
        if self.cuda_graphs:
            _mark_static(_weights(forward))

    def step(
        self, keys: list[torch.Tensor], values: list[torch.Tensor], tokens: torch.Tensor, parents: torch.Tensor,
        sizes: torch.Tensor, lengths: torch.Tensor, start: torch.Tensor, uniforms: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One step of padded trees [B, W] (`tree.packed_fields`: tokens and parents, pads -1) over buffers of
        capacity C whose committed region is `start` slots wide (a 0-d tensor): (packed paths [B, 2W + 2] as
        `packed_paths`, the features and, with `keep_logits`, the logits of each row's path nodes [B, W, ...],
        root first). The accepted slots are moved down in the buffers."""
        batch, width = tokens.shape
        capacity, device = keys[0].shape[2], tokens.device
        nodes = torch.arange(width, device=device)
        real = nodes < sizes[:, None]  # [B, W]
        depth, tree_mask = tree_structure(parents)  # a pad (parent -1) is a root of its own, depth 0
        tree_mask = tree_mask & real[:, :, None] & real[:, None, :]  # pad rows and columns empty, as `pad_trees`
        slots = start + nodes  # the tree's slots, after the committed region
        context = torch.arange(capacity, device=device) < lengths[:, None]  # [B, C]
        own = torch.eye(width, dtype=torch.bool, device=device) & ~real[:, :, None]  # padding sees itself: no NaN
        mask = (context[:, None, :] & real[:, :, None]).index_copy(2, slots, tree_mask | own)  # [B, W, C]
        positions = torch.where(real, lengths[:, None] + depth, 0)
        # no window narrower than the capacity (`covers`): `past` is only their bound
        masks, _ = self.forward.attention_masks(mask[:, None], positions, capacity - width, self.forward.embed.dtype)

        def write(layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return keys[layer][:batch].index_copy_(2, slots, k), values[layer][:batch].index_copy_(2, slots, v)

        hidden, features = self.forward.decode(tokens.clamp(min=0), positions,
                                               self.forward.layer_attention(masks, False, write), self.feature_layers)
        logits = self.forward.logits(hidden)
        node_uniforms = None if uniforms is None else uniforms.gather(1, depth)
        packed = packed_paths(tokens, parents, depth, tree_mask, sizes, shared_choices(logits, self.params,
                                                                                      node_uniforms))
        path = packed[:, 1 : 1 + width]
        accepted = torch.where(sizes > 0, packed[:, 0], 0)  # rows without a tree keep their slots
        upto = torch.minimum(nodes, (accepted - 1).clamp(min=0)[:, None])  # [B, W]: the last pair repeated
        moving = accepted[:, None] > 0
        source = torch.where(moving, start + path.gather(1, upto), 0)
        target = torch.where(moving, lengths[:, None] + upto, 0)
        for buffer in (*keys, *values):
            move_slots(buffer[:batch], source, target)
        on_path = path.clamp(max=width - 1)
        kept_features = features.gather(1, on_path[:, :, None].expand(-1, -1, features.shape[-1]))
        kept_logits = logits.gather(1, on_path[:, :, None].expand(-1, -1, logits.shape[-1])) if self.keep_logits \
            else None
        return packed, kept_features, kept_logits

    def covers(self, capacity: int) -> bool:
        """Whether every layer's window is at least the cache's capacity (or full attention)."""
        return all(window is None or window >= capacity for window in self.forward.windows)

    def __call__(self, keys: list[torch.Tensor], values: list[torch.Tensor], tokens: torch.Tensor,
                 parents: torch.Tensor, sizes: torch.Tensor, lengths: torch.Tensor, start: torch.Tensor,
                 uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`step`; on CUDA the new cache buffers are marked static first. The outputs of a CUDA graph are
        overwritten by its next replay: callers copy what they keep."""
        if self.cuda_graphs:
            _mark_static([*keys, *values])  # a buffer `reserve` reallocated is new
        self.forward.check_sources()
        return self.run(keys, values, tokens, parents, sizes, lengths, start, uniforms)


def _weights(forward: FastLlama) -> list[torch.Tensor]:
    """Every tensor the step reads from the forward: embeddings, norms, projections' weights and biases."""
    projections = [forward.lm_head, *(p for layer in forward.layers for p in (layer.qkv, layer.o, layer.gate_up,
                                                                            layer.down))]
    norms = [n for layer in forward.layers for n in (layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm)]
    tensors = [forward.embed, forward.norm, *norms, *(t for p in projections for t in (p.weight, p.bias))]
    return [t for t in tensors if t is not None]


def _mark_static(tensors: list[torch.Tensor]) -> None:
    """Mark tensors not marked yet as static addresses of the CUDA graphs (weights, cache buffers)."""
    for tensor in tensors:
        if getattr(tensor, "_dynamo_static_input_type", None) is None:
            torch._dynamo.mark_static_address(tensor)


def step_graph(forward: FastLlama, params: SamplingParams, feature_layers: tuple[int, ...], keep_logits: bool,
               compiled: bool) -> StepGraph:
    """The forward's captured step for these settings, made once and kept on the forward (graphs are bound to the
    object they were compiled for; a new object would compile again)."""
    graphs: dict[tuple, StepGraph] = forward.__dict__.setdefault("step_graphs", {})
    key = (params, feature_layers, keep_logits, compiled)
    if key not in graphs:
        graphs[key] = StepGraph(forward, params, feature_layers, keep_logits, compiled)
    return graphs[key]
