"""Which cells run live and on how many questions: replayed T = 0 cells take whole benchmarks, live cells (T > 0,
plain decoding) the first `eval.live_questions`, with `eval.live_proposers` at T > 0."""

from __future__ import annotations

from taps_ray.eval.cell import NO_HEAD, PLAIN, Cell
from taps_ray.eval.commands import plan_cells
from taps_ray.eval.runner import cell_questions, run_cell


def _configured(cfg, **update):
    cfg.eval = cfg.eval.model_copy(update=update)
    return cfg


def test_live_cells_take_fewer_questions_and_their_own_proposers(tiny_config):
    cfg = _configured(tiny_config, benchmarks={"gsm8k": 5, "mt_bench": 2}, temperatures=[0.0, 1.0],
                      proposers=["math", "chat", "merged"], live_proposers=["math"], live_questions=3, replay=True)
    cells = plan_cells(cfg)
    at = {t: {(c.head_kind, c.proposer) for c in cells if c.temperature == t} for t in (0.0, 1.0)}
    kinds = cfg.train.kinds
    assert at[0.0] == {(NO_HEAD, PLAIN)} | {(k, p) for k in kinds for p in ("math", "chat", "merged")}
    assert at[1.0] == {(NO_HEAD, PLAIN)} | {(k, "math") for k in kinds}
    counts = {(c.proposer, c.benchmark, c.temperature): cell_questions(cfg, c) for c in cells}
    assert counts[("merged", "gsm8k", 0.0)] == 5  # replayed: the whole benchmark
    assert counts[(PLAIN, "gsm8k", 0.0)] == 3  # plain stays live, the speed baseline
    assert counts[("math", "gsm8k", 1.0)] == 3
    assert counts[("math", "mt_bench", 1.0)] == 2  # never more than the benchmark's count
    explicit = plan_cells(cfg, proposers=["chat"], temperatures=[1.0])  # an explicit list overrides both
    assert {c.proposer for c in explicit} == {PLAIN, "chat"}


def test_replay_off_makes_every_cell_live(tiny_config):
    cfg = _configured(tiny_config, benchmarks={"gsm8k": 5}, live_questions=2, replay=False)
    assert {cell_questions(cfg, c) for c in plan_cells(cfg)} == {2}


def test_a_live_cell_evaluates_live_questions(tiny_config, tiny_target):
    cfg = _configured(tiny_config, benchmarks={"gsm8k": 3}, live_questions=2, max_new_tokens=4, replay=True)
    _, questions = run_cell(cfg, Cell(NO_HEAD, PLAIN, "gsm8k", 1.0), tiny_target, {})
    assert len(questions) == 2
