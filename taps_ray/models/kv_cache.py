"""A preallocated key/value cache for a batch of right-padded sequences, owned by the target's `TargetBatch`.

Why not transformers' `DynamicCache`: it concatenates each layer's keys and values onto a new tensor at every
forward (a copy of the whole cache per layer per step), and the batch then copied it again to move accepted tree
slots, crop it or drop rows. Here every layer has one buffer [rows, kv_heads, capacity, head_dim] allocated
once; a forward writes its slots in place (`append`), accepted tree nodes are moved down in place
(`move_slots`), cropping only moves a number (`crop`), and rows are kept or evicted by index in place
(`keep_rows`). The capacity grows by doubling, so a buffer is reallocated (and copied) a logarithmic number
of times per sequence, never per forward.

The invariant is the batch's: the committed region is `width` slots wide (the longest sequence); a row's slots
past its own length hold anything and are never attended (the batch's masks see to it). During a forward
every layer appends its T new slots after `width`; `advance(T)` then widens the region once for all layers.
Plain torch, no transformers import: both target forwards (taps' own and transformers', through an adapter in
`models/hf_forward.py`) write into it.
"""

from __future__ import annotations

import torch

GROWTH = 256  # slots: capacities are multiples of this (one reallocation per 256 slots at first, then doubling)


def _capacity(needed: int, current: int) -> int:
    """The next capacity holding `needed` slots: at least double the current one, rounded up to `GROWTH`."""
    wanted = max(needed, 2 * current)
    return -(-wanted // GROWTH) * GROWTH


def _grown_rows(needed: int, current: int, most: int | None) -> int:
    """Rows for buffers that must hold `needed` (more than the `current` ones): the next power of two, at most
    `most` (the batch's cap, which `taps plan` sizes the cache by), so a batch filling up one request at a time
    reallocates a logarithmic number of times and never holds more rows than its cap."""
    if needed <= current:
        return current
    doubled = 1 << (needed - 1).bit_length()
    return max(needed, doubled if most is None else min(doubled, most))


def grown_capacity(prefill: int, final: int) -> int:
    """The slots a cache holds once `prefill` slots were written in one forward and it then grew a few slots per
    forward up to `final`: up to about twice `final` (`taps plan` sizes every KV cache with it)."""
    return _capacities(prefill, final)[-1]


def previous_capacity(prefill: int, final: int) -> int:
    """The capacity before `grown_capacity`'s last reallocation (0: none): a cache whose layers share one storage
    holds that old copy beside the new one while it grows (`taps plan` counts it as a transient)."""
    capacities = _capacities(prefill, final)
    return capacities[-2] if len(capacities) > 1 else 0


def _capacities(prefill: int, final: int) -> list[int]:
    capacities = [_capacity(prefill, 0)]
    while capacities[-1] < final:
        capacities.append(_capacity(capacities[-1] + 1, capacities[-1]))
    return capacities


def _holds(buffer: torch.Tensor | None, keys: torch.Tensor, slots: int) -> bool:
    """Whether a layer's buffer can take `keys`' heads and head_dim up to `slots` slots: the one storage is
    allocated for every layer from the first layer's keys, and a layer of another shape gets its own buffers."""
    return buffer is not None and buffer.shape[2] >= slots and (buffer.shape[1], buffer.shape[3], buffer.dtype) == (
        keys.shape[1], keys.shape[3], keys.dtype)


class KVCache:
    """Keys and values of `num_layers` layers for `rows` sequences; buffers are allocated on the first append
    (the shapes come from the model's own key states, so any full-attention architecture fits).

    Where every layer's keys and values have one shape (heads, head_dim, dtype: every Llama-shaped target), the
    layers' buffers are views of one storage [2, layers, rows, heads, capacity, head_dim], allocated and grown for
    all layers at once, so moving slots or rows is two indexing ops for the whole cache instead of two per buffer
    (120 for SmolLM2's 30 layers: 4% of a batch-16 decode step). A layer of another shape gets buffers of its own."""

    def __init__(self, num_layers: int, rows: int = 0) -> None:
        self.num_layers = num_layers
        self.rows = rows
        self.width = 0
        self._keys: list[torch.Tensor | None] = [None] * num_layers
        self._values: list[torch.Tensor | None] = [None] * num_layers
        self._storage: torch.Tensor | None = None  # every layer's buffers, while they share one shape

    def _block_ids(self, slots: torch.Tensor) -> torch.Tensor:
        """Where row b's slots `slots[b]` ([rows, n]) lie in the storage viewed as [2 * layers, blocks, head_dim]:
        one id per (row, head, slot), the same in every layer. Why blocks: indexing the storage with a row and a slot
        index (two advanced indices) copied element by element, 2.7x slower at batch 16 (ad hoc, bf16, 1 thread)."""
        heads, capacity = self._storage.shape[3], self._storage.shape[4]
        rows = torch.arange(slots.shape[0], device=slots.device)[:, None, None]
        head = torch.arange(heads, device=slots.device)[None, :, None]
        return ((rows * heads + head) * capacity + slots[:, None, :]).reshape(-1)

    def reset(self, rows: int) -> None:
        """Empty the cache for `rows` new sequences; the buffers are reused when they have room for the rows."""
        for layer, buffer in enumerate(self._keys):
            if buffer is not None and buffer.shape[0] < rows:
                self._keys[layer] = self._values[layer] = None
        if self._storage is not None and self._storage.shape[2] < rows:
            self._storage = None
        self.rows, self.width = rows, 0

    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a forward's new keys and values [rows, heads, T, head_dim] after the committed region and return
        the layer's keys and values over committed + new slots (views: nothing is copied)."""
        if keys.shape[0] != self.rows:
            raise ValueError(f"a forward of {keys.shape[0]} rows on a cache of {self.rows} rows")
        end = self.width + keys.shape[2]
        buffer_k, buffer_v = self._keys[layer], self._values[layer]
        if not _holds(buffer_k, keys, end):
            buffer_k, buffer_v = self._grown(layer, keys, end)
        buffer_k[: self.rows, :, self.width : end] = keys
        buffer_v[: self.rows, :, self.width : end] = values
        return buffer_k[: self.rows, :, :end], buffer_v[: self.rows, :, :end]

    def _grown(self, layer: int, like: torch.Tensor, needed: int, rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's buffers reallocated to hold `needed` slots (and at least `rows` rows), the committed region
        copied over."""
        old_k, old_v = self._keys[layer], self._values[layer]
        current = 0 if old_k is None else old_k.shape[2]
        rows = max(rows, self.rows, 0 if old_k is None else old_k.shape[0])
        capacity = current if needed <= current else _capacity(needed, current)  # `reserve` may want rows only
        if self._shares_storage(like):
            return self._grown_storage(layer, like, rows, capacity)
        shape = (rows, like.shape[1], capacity, like.shape[3])
        # zeros, not empty: a captured step attends over the whole capacity, and a masked slot's value still
        # enters the product with weight 0, where uninitialised memory's NaN would make NaN
        new_k = torch.zeros(shape, dtype=like.dtype, device=like.device)
        new_v = torch.zeros(shape, dtype=like.dtype, device=like.device)
        if _holds(old_k, like, 0) and self.width:  # not the storage's view of another shape, which holds nothing
            new_k[: self.rows, :, : self.width] = old_k[: self.rows, :, : self.width]
            new_v[: self.rows, :, : self.width] = old_v[: self.rows, :, : self.width]
        self._keys[layer], self._values[layer] = new_k, new_v
        self._storage = None  # a layer with buffers of its own: the layers are moved one by one
        return new_k, new_v

    def _shares_storage(self, like: torch.Tensor) -> bool:
        """Whether a layer's new buffers can be (or stay) views of the one storage: every layer holds nothing yet,
        or views of it, and `like` has its heads, head_dim, dtype and device."""
        if self._storage is None:
            return all(buffer is None for buffer in self._keys)
        storage = self._storage
        return (like.shape[1], like.shape[3], like.dtype, like.device) == (
            storage.shape[3], storage.shape[5], storage.dtype, storage.device)

    def _grown_storage(self, layer: int, like: torch.Tensor, rows: int, capacity: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's buffers reallocated at once as views of a new storage (zeros, as `_grown` says why), the
        committed region copied over; returns `layer`'s."""
        old = self._storage
        if old is not None:
            rows, capacity = max(rows, old.shape[2]), max(capacity, old.shape[4])
        shape = (2, self.num_layers, rows, like.shape[1], capacity, like.shape[3])
        storage = torch.zeros(shape, dtype=like.dtype, device=like.device)
        if old is not None and self.width:
            storage[:, :, : self.rows, :, : self.width] = old[:, :, : self.rows, :, : self.width]
        self._storage = storage
        self._keys[:], self._values[:] = storage[0].unbind(0), storage[1].unbind(0)  # in place: callers iterate
        return self._keys[layer], self._values[layer]

    def write_row(self, layer: int, row: int, keys: torch.Tensor, values: torch.Tensor, slots: int) -> None:
        """Write one sequence's keys and values [heads, n, head_dim] at its slots 0..n-1 of row `row` (a prompt
        prefilled beside a step, `FastLlama.with_prompts`); the buffers hold at least `slots` slots. `advance` then
        widens the region to the longest row."""
        if not _holds(self._keys[layer], keys[None], slots):
            self._grown(layer, keys[None], slots)
        self._keys[layer][row, :, : keys.shape[1]] = keys
        self._values[layer][row, :, : values.shape[1]] = values

    def advance(self, slots: int) -> None:
        """Every layer has appended `slots` slots: the region now covers them (until `move_slots` or `crop`)."""
        self.width += slots

    def crop(self, width: int) -> None:
        """Keep only the first `width` slots (nothing moves)."""
        if width > self.width:
            raise ValueError(f"cannot crop a cache of {self.width} slots to {width}")
        self.width = width

    def move_slots(self, source: torch.Tensor, target: torch.Tensor, width: int) -> None:
        """Row b's slots `source[b]` go to its slots `target[b]` ([rows, n] each; a pair may repeat), in place for
        every layer, then the region is `width` slots wide. Only the moved slots are read and written: a batch of
        ragged sequences moves its few accepted tree slots, not the span between its shortest and longest."""
        if self._storage is not None:  # every layer at once, as whole key/value vectors of the storage's blocks
            blocks = self._storage.view(2 * self.num_layers, -1, self._storage.shape[-1])
            blocks.index_copy_(1, self._block_ids(target), blocks.index_select(1, self._block_ids(source)))
        else:
            for buffer in (*self._keys, *self._values):
                if buffer is not None:
                    move_slots(buffer[: self.rows], source, target)
        self.width = width

    def reserve(self, rows: int, slots: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every layer's whole buffers, keys then values [>= rows, heads, capacity >= slots, head_dim], reallocated
        (the committed region copied) where smaller: the fixed-capacity cache a captured step writes and moves
        slots in itself (decoding/captured_step.py); its capacity changes a logarithmic number of times."""
        for layer, buffer in enumerate(self._keys):
            if buffer is None:
                raise ValueError(f"layer {layer} of the cache holds nothing yet (no forward has run)")
            if buffer.shape[0] < rows or buffer.shape[2] < slots:
                self._grown(layer, buffer, slots, rows)
        return list(self._keys), list(self._values)

    def stepped(self, width: int) -> None:
        """A captured step wrote its slots and moved the accepted ones into `reserve`'s buffers itself: the
        region is now `width` slots wide."""
        self.width = width

    def keep_rows(self, keep: list[int], width: int) -> None:
        """Keep the rows `keep` (in that order) as rows 0..len-1, cropped to `width` slots, in place. Only rows that
        change place are copied: a request leaving a batch of 16 moves the rows after it, not all 15, and the
        buffers keep their rows for the next request to join in place (`merge`)."""
        moved = [(to, row) for to, row in enumerate(keep) if to != row]
        if moved and self._storage is not None:  # every layer at once
            _copy_rows(self._storage, 2, moved, width)
        elif moved:
            for buffer in (*self._keys, *self._values):
                if buffer is not None:
                    _copy_rows(buffer, 0, moved, width)
        self.rows, self.width = len(keep), width

    def take_rows(self, index: torch.Tensor, width: int) -> KVCache:
        """A new cache holding copies of the rows `index`, `width` slots wide."""
        sub = KVCache(self.num_layers, rows=len(index))
        sub.width = width
        for layer in range(self.num_layers):
            buffer_k, buffer_v = self._keys[layer], self._values[layer]
            if buffer_k is None:
                continue
            sub._grown(layer, buffer_k, width)
            sub._keys[layer][:, :, :width] = buffer_k[index, :, :width]
            sub._values[layer][:, :, :width] = buffer_v[index, :, :width]
        return sub

    def put_rows(self, index: torch.Tensor, sub: KVCache, since: int) -> None:
        """Write the slots `since`.. of a stepped `take_rows` cache back into the rows `index` (the slots before
        `since` are unchanged copies); the region widens to the sub-cache's width if it grew past it."""
        width = max(self.width, sub.width)
        for layer in range(self.num_layers):
            theirs_k, theirs_v = sub._keys[layer], sub._values[layer]
            if theirs_k is None:
                continue
            if self._keys[layer] is None or self._keys[layer].shape[2] < width:
                self._grown(layer, theirs_k, width)
            self._keys[layer][index, :, since : sub.width] = theirs_k[:, :, since : sub.width]
            self._values[layer][index, :, since : sub.width] = theirs_v[:, :, since : sub.width]
        self.width = width

    def merge(self, other: KVCache, max_rows: int | None = None) -> None:
        """Append `other`'s rows after these; the narrower region is padded (padding slots are never attended).
        Written in place where the buffers have the rows and slots (they keep the rows of requests that left), so
        a request joining a running batch copies its own slots only; otherwise the buffers are reallocated with
        room to grow (`_grown` with `_grown_rows`): a burst of requests joining one step after another reallocated
        (zeroed and copied) the whole cache at each join, 10% of a served replica's compute under 16 clients.
        `max_rows`: the most rows the batch will hold (None: no cap on the growth beyond a power of two)."""
        if other.num_layers != self.num_layers:
            raise ValueError(f"cannot merge a cache of {other.num_layers} layers into one of {self.num_layers}")
        width = max(self.width, other.width)
        rows = self.rows + other.rows
        for layer in range(self.num_layers):
            like = self._keys[layer] if self._keys[layer] is not None else other._keys[layer]
            if like is None:
                continue
            held = self._keys[layer]
            if held is None or held.shape[0] < rows or held.shape[2] < width:
                self._grown(layer, like, width, _grown_rows(rows, 0 if held is None else held.shape[0], max_rows))
            for buffers, source in ((self._keys, other._keys), (self._values, other._values)):
                if source[layer] is not None:
                    buffers[layer][self.rows : rows, :, : other.width] = source[layer][: other.rows, :, : other.width]
        self.rows, self.width = rows, width

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s keys and values over the committed region, [rows, heads, width, head_dim] (views)."""
        keys, values = self._keys[index], self._values[index]
        if keys is None or values is None:
            raise ValueError(f"layer {index} of the cache holds nothing yet (no forward has run)")
        return keys[: self.rows, :, : self.width], values[: self.rows, :, : self.width]


def _copy_rows(buffer: torch.Tensor, row_dim: int, moved: list[tuple[int, int]], width: int) -> None:
    """Copy row `row` of `buffer` (rows on `row_dim`, slots two dimensions later) onto row `to` for each pair
    `(to, row)` of `moved` in order, over the first `width` slots; a row overwritten before a later pair reads it
    is read from a copy taken first. One contiguous copy per row: an advanced index over the rows copied element
    by element, 13x slower for 11 rows of 346 slots at batch 16 (ad hoc, bf16, 1 thread)."""
    def row_slots(row: int) -> torch.Tensor:
        return buffer.select(row_dim, row).narrow(row_dim + 1, 0, width)

    written: set[int] = set()
    overwritten: set[int] = set()
    for to, row in moved:
        if row in written:
            overwritten.add(row)
        written.add(to)
    saved = {row: row_slots(row).clone() for row in overwritten}
    for to, row in moved:
        row_slots(to).copy_(saved.get(row, row_slots(row)))


def move_slots(rows: torch.Tensor, source: torch.Tensor, target: torch.Tensor) -> None:
    """Row b's slots `source[b]` to its slots `target[b]` ([rows, n] each) of one buffer [rows, heads, slots, d],
    in place (a pair may repeat)."""
    row = torch.arange(rows.shape[0], device=rows.device)[:, None]
    write_slots(rows, target, rows[row, :, source].transpose(1, 2))  # the read is a copy: sources may be targets


def write_slots(rows: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """Write `values` [rows, heads, n, d] at each row's own slots `slots` [rows, n] of a buffer [rows, heads,
    slots, d], in place. Indexed assignment rather than `scatter_`: on the CPU `scatter_` of bfloat16 measured
    19x slower than of float32 (650 against 34 µs a call at batch 16), indexing as fast in both (~20 µs)."""
    row = torch.arange(rows.shape[0], device=rows.device)[:, None]
    rows[row, :, slots] = values.transpose(1, 2)
