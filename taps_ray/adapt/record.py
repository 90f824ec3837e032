"""What a replica records of its traffic: the verify forward's features at committed positions and the tokens.

A sampled request (`Recorder.start`: a seeded draw of `sample`, at most `max_per_minute`) gets a `Recording` whose
`on_commit` the batcher calls with each `Committed` (the prefill's, then each step's). It keeps references only:
`Committed` owns its tensors, no forward is added and nothing is copied on the decoding thread. When the request
finishes, the pieces become one training `Example` on the recorder's own writer thread:
positions 0..N-1 with token x_0 = prompt[0] and x_{i+1} = the i-th committed next token, features h_i, and a
loss mask over the generated positions (the target's own answer, the traffic the head must draft).
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from taps_ray.adapt.buffer import Tag, TrafficBuffer
from taps_ray.decoding.target_batch import Committed
from taps_ray.training.features import HIDDEN_DTYPE, Example

logger = logging.getLogger(__name__)

Piece = tuple[torch.Tensor, torch.Tensor]  # (features [m, d], next tokens [m]) of one commit


def as_example(prompt: list[int], pieces: list[Piece], example_id: str) -> Example:
    """A recorded sequence in the training feature format: hidden[i] is the target's feature at position i and
    input_ids[i] the token there; the last committed next token has no feature yet and is left out."""
    features = torch.cat([f for f, _ in pieces]).to("cpu", HIDDEN_DTYPE)
    following = torch.cat([t for _, t in pieces]).to("cpu", torch.long)
    ids = torch.cat([torch.tensor([prompt[0]]), following[:-1]])
    mask = (torch.arange(len(ids)) >= len(prompt)).float()
    return Example(example_id, ids, mask, features, None, None)


class Recording:
    """One sampled request's commits, in order (the batcher's `on_commit`)."""

    def __init__(self, prompt: list[int]) -> None:
        self.prompt = prompt
        self.pieces: list[Piece] = []

    def on_commit(self, committed: Committed) -> None:
        self.pieces.append((committed.features, committed.next_tokens))


class Recorder:
    """Samples requests, gathers finished recordings and writes them to the buffer `flush_tokens` at a time, on
    one writer thread (never the decoding thread)."""

    def __init__(self, buffer: TrafficBuffer, sample: float, max_per_minute: int, flush_tokens: int, seed: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.buffer, self.sample, self.max_per_minute, self.flush_tokens = buffer, sample, max_per_minute, flush_tokens
        self.clock = clock
        self._rng = random.Random(seed)
        self._recent: deque[float] = deque()  # when the last minute's recordings started
        self._pending: list[tuple[Example, Tag]] = []
        self._lock = threading.Lock()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="taps-adapt-record")
        self.recorded = 0
        self.buffer_tokens = buffer.tokens  # after the last write (the metrics read it: no file read per request)

    def start(self, prompt: list[int]) -> Recording | None:
        """A recording for a new request, or None: not drawn, or the minute's quota is spent."""
        now = self.clock()
        while self._recent and now - self._recent[0] >= 60.0:
            self._recent.popleft()
        if len(self._recent) >= self.max_per_minute or self._rng.random() >= self.sample:
            return None
        self._recent.append(now)
        return Recording(list(prompt))

    def finish(self, recording: Recording, ok: bool, tag: Tag | None = None) -> None:
        """The request ended: keep its recording (unless it failed or committed nothing) for the writer, with `tag`
        (what the buffer keeps beside it: a routed model's head and whether it decoded low)."""
        if ok and recording.pieces:
            self._writer.submit(self._keep, recording, tag or {})

    def flush(self) -> Future:
        """Write whatever is pending now (shutdown, tests); the future resolves once it is in the buffer."""
        return self._writer.submit(self._write)

    def _keep(self, recording: Recording, tag: Tag) -> None:
        try:
            example = as_example(recording.prompt, recording.pieces, uuid.uuid4().hex)
            with self._lock:
                self._pending.append((example, tag))
                full = sum(len(e) for e, _ in self._pending) >= self.flush_tokens
            if full:
                self._write()
        except Exception:  # recording is best effort: serving goes on without it
            logger.exception("recording a request failed")

    def _write(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        if pending:
            self.buffer.add([e for e, _ in pending], [t for _, t in pending])
            self.recorded += len(pending)
            self.buffer_tokens = self.buffer.tokens
