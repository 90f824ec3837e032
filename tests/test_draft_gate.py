"""The step-level drafting decision (decoding/draft_gate.py): a fixed cap and the measured rule."""

from __future__ import annotations

import pytest

from taps_ray.decoding.draft_gate import DraftGate, bucket, bucket_label


def _feed(gate: DraftGate, batch: int, steps: int, drafted_rate: int, plain_rate: int,
          self_timed: bool = False) -> list[bool]:
    """Run `steps` steps at `batch` where a drafted step commits `drafted_rate` tokens in one second and an
    undrafted one `plain_rate`; returns what the gate chose at each."""
    chosen = []
    for _ in range(steps):
        drafts = gate.drafts(batch, self_timed)
        chosen.append(drafts)
        gate.observe(batch, drafts, 1.0, drafted_rate if drafts else plain_rate, self_timed)
    return chosen


def test_buckets_group_batch_sizes_by_powers_of_two():
    assert [bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [0, 1, 2, 2, 3, 3, 4, 4, 5]
    assert [bucket_label(k) for k in range(6)] == ["1", "2", "3-4", "5-8", "9-16", "17-32"]


def test_the_measured_rule_drafts_where_drafting_commits_more_per_second_and_probes_the_other():
    gate = DraftGate(measured=True, warmup=2, probe_every=8)
    alone = _feed(gate, 1, 34, drafted_rate=3, plain_rate=1)
    assert alone[:2] == [True, False]  # warm-up in turn, cut short: drafting commits 3x as much per second
    # then drafting, an undrafted probe after 8 steps; it confirms the choice, so the next comes 16 steps later
    assert alone[2:] == [i not in (7, 23) for i in range(32)]
    assert gate.intervals[bucket(1)] == 32
    crowded = _feed(gate, 16, 36, drafted_rate=10, plain_rate=16)  # a separate bucket, measured on its own
    assert crowded[:4] == [True, False, True, False]  # 16 against 10 is no clear margin: the whole warm-up
    assert crowded[4:] == [i in (7, 23) for i in range(32)]  # plain wins at 16: drafting only to re-measure it
    capped = DraftGate(measured=True, warmup=1, probe_every=2, max_probe_every=4)
    assert _feed(capped, 1, 18, drafted_rate=1, plain_rate=3)[2:] == [i in (1, 5, 9, 13) for i in range(16)]


def test_a_bucket_without_measurements_follows_its_neighbours():
    """Drafting that lost at a smaller batch is not warmed up at a larger one (the forward only gets more
    compute-bound): the larger bucket starts undrafted and measures drafting by its probes."""
    gate = DraftGate(measured=True, warmup=2, probe_every=4)
    _feed(gate, 2, 8, drafted_rate=1, plain_rate=2)  # plain wins at 2
    assert gate.winner(bucket(2)) is False and gate.winner(bucket(16)) is False and gate.winner(bucket(1)) is None
    crowded = _feed(gate, 16, 12, drafted_rate=5, plain_rate=16)
    assert crowded == [i in (3, 11) for i in range(12)]  # no drafted warm-up: probes only, backing off
    assert gate.winner(bucket(16)) is False and gate.rates[(bucket(16), True)].steps == 2  # now its own measurement
    winning = DraftGate(measured=True, warmup=2)
    _feed(winning, 16, 4, drafted_rate=30, plain_rate=16)  # drafting wins at 16 (a GPU's memory-bound forward)
    assert winning.winner(bucket(4)) is True and winning.drafts(4)  # so it drafts at 4 from the first step


def test_the_measured_rule_follows_a_change_in_the_traffic():
    gate = DraftGate(measured=True, warmup=2, probe_every=4)
    assert _feed(gate, 4, 12, drafted_rate=4, plain_rate=8)[:6] == [True, False, False, False, False, True]
    assert gate.winner(bucket(3)) is False  # drafting lost by half after one step each: undrafted, a probe
    later = _feed(gate, 4, 30, drafted_rate=20, plain_rate=8)  # the heads now match the traffic
    assert later[-8:].count(True) >= 6  # the probes saw it: drafting again, undrafted probes only


def test_one_stalled_step_does_not_flip_a_bucket():
    """Undrafted steps of 40 ms against drafted ones of 47 ms, both committing a token: one undrafted step stalled
    for 0.7 s (a garbage collection, the OS) must not hand the bucket to drafting."""
    gate = DraftGate(measured=True, warmup=3, probe_every=4)
    for drafted in (True, False) * 3:  # the warm-up, in turn
        assert gate.drafts(1) is drafted
        gate.observe(1, drafted, 0.047 if drafted else 0.040, 1)
    assert gate.winner(bucket(1)) is False
    gate.observe(1, False, 0.7, 1)
    assert gate.winner(bucket(1)) is False and gate.rates[(bucket(1), False)].tokens_per_s == pytest.approx(25.0)
    gate.observe(1, False, 0.7, 1)  # a second stall among the last five is not one step's accident
    assert gate.winner(bucket(1)) is True


def test_a_bucket_that_left_its_choice_for_a_few_slow_steps_measures_it_again_soon():
    """At 16 in flight, undrafted steps commit 3x what drafted ones do per second; the probes have backed off to
    every 256th step. Four undrafted steps slowed six-fold (a server resumed from a pause) hand the bucket to
    drafting. The undrafted kind is measured again within a few steps: before, its window kept the slow steps
    until the rare probes replaced them, and the bucket drafted for the next 126 of 130 steps."""
    gate = DraftGate(measured=True)
    _feed(gate, 16, 2000, drafted_rate=133, plain_rate=400)
    assert gate.winner(bucket(16)) is False and gate.intervals[bucket(16)] == 256
    chosen = []
    for _ in range(4):
        drafts = gate.drafts(16)
        chosen.append(drafts)
        gate.observe(16, drafts, 6.0 if not drafts else 1.0, 400 if not drafts else 133)
    assert gate.winner(bucket(16)) is True  # the slow steps did hand it over
    chosen += _feed(gate, 16, 126, drafted_rate=133, plain_rate=400)
    assert chosen.count(True) <= 8 and chosen[-100:].count(True) <= 2  # then probes only, backing off
    assert gate.winner(bucket(16)) is False


def test_a_step_the_gate_cannot_time_runs_the_known_winner_and_neither_warms_up_nor_probes():
    """A request joining a step makes its time the prefill's, so the gate does not observe it. Such a step drafts
    only where drafting is known to win: not in a bucket still warming up (Serve's ramp of a closed loop of 16
    joined one request a step, each at a new batch size, and every such step drafted), and it is never a probe."""
    gate = DraftGate(measured=True, warmup=2, probe_every=4)
    assert not any(gate.drafts(batch, timed=False) for batch in range(2, 17))  # nothing known: undrafted
    assert not gate.rates and not gate.decided  # no warm-up step counted, no probe interval advanced
    _feed(gate, 16, 8, drafted_rate=5, plain_rate=16)  # plain wins at 16, the probe interval runs
    decided = dict(gate.decided)
    assert not any(gate.drafts(16, timed=False) for _ in range(20)) and gate.decided == decided  # no probe
    winning = DraftGate(measured=True, warmup=2)
    _feed(winning, 4, 4, drafted_rate=30, plain_rate=16)
    assert winning.drafts(4, timed=False) and winning.drafts(2, timed=False)  # known (or followed) winners draft
    assert winning.drafts(1, self_timed=True, timed=False)  # a lone self-timing proposer still decides itself


def test_a_lone_self_timing_proposer_decides_for_itself():
    """At batch 1 a cost-aware proposer's own timings hold no neighbour's tree: the gate lets it draft and keeps no
    rate there; from batch 2 on the measured rule decides as for any proposer."""
    gate = DraftGate(measured=True, warmup=1, probe_every=4)
    assert _feed(gate, 1, 12, drafted_rate=1, plain_rate=3, self_timed=True) == [True] * 12
    assert not gate.rates
    assert _feed(gate, 2, 12, drafted_rate=1, plain_rate=3, self_timed=True)[2:] == [i in (3, 11) for i in range(10)]
    assert _feed(gate, 1, 4, drafted_rate=1, plain_rate=3)[2:] == [False, False]  # not self-timed: measured
    assert gate.rates[(bucket(1), True)].steps == 1
    assert not _feed(DraftGate(draft_below=1, measured=True), 1, 3, 3, 1, self_timed=True)[0]  # the cap still holds


def test_a_cap_wins_over_measurement_and_bad_settings_are_refused():
    gate = DraftGate(draft_below=4, measured=True, warmup=1)
    assert _feed(gate, 4, 5, drafted_rate=100, plain_rate=1) == [False] * 5  # at the cap: never drafts
    assert gate.rates[(bucket(4), False)].steps == 5 and (bucket(4), True) not in gate.rates
    assert DraftGate().drafts(64) and not DraftGate(draft_below=1).drafts(1)  # unmeasured: only the cap decides
    with pytest.raises(ValueError, match="draft_below must be at least 1"):
        DraftGate(draft_below=0)
    with pytest.raises(ValueError, match="probe_every"):
        DraftGate(probe_every=1)
    with pytest.raises(ValueError, match="max_probe_every"):
        DraftGate(probe_every=64, max_probe_every=32)
