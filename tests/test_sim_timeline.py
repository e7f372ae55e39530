"""Per-request timelines of the simulator against schedules computed by hand."""

import dataclasses
import random
from fractions import Fraction

import pytest

from distserve.core.timeline import RequestTimeline, read_jsonl, write_jsonl
from placement.simulator import (
    ColocatedInstanceSpec,
    Contention,
    DecodeInstanceSpec,
    PrefillInstanceSpec,
    SimRequest,
    simulate,
    simulate_colocated,
)
from placement.workload import arrival_times

# Exact arithmetic, so that events the hand schedule puts at one instant are at one instant.
STEP = Fraction(1, 10)
TRANSFER = Fraction(1, 2)


def batch_time(lens):
    return 1 + Fraction(1, 100) * sum(lens)


def step_time(batch_size, context):
    return STEP


def transfer(tokens):
    return TRANSFER


def prefill_spec(block_size=16, kv=10_000, **kw):
    return PrefillInstanceSpec(1, batch_time, None, 4096, kv, block_size, **kw)


def decode_spec(block_size=16, kv=10_000, **kw):
    return DecodeInstanceSpec(1, step_time, None, 256, kv, block_size, **kw)


def plain(timeline):
    """The timeline's JSON with exact times as floats (``float(Fraction(13, 10)) == 1.3``)."""

    def conv(x):
        if isinstance(x, list):
            return [conv(v) for v in x]
        return float(x) if isinstance(x, Fraction) else x

    return {k: conv(v) for k, v in timeline.to_json().items()}


def expected(request_id, prompt_len, output_len, arrival, **fields):
    return RequestTimeline(str(request_id), prompt_len, output_len, arrival, **fields).to_json()


def test_disaggregated_timeline_by_hand():
    # A and B arrive together and share a prefill batch (30 tokens: 1.3 s); C arrives during it and waits.
    # Decode admits A and B at 1.3, but its link moves one pull at a time: A 1.3-1.8, B 1.8-2.3. A decodes
    # alone from 1.8; B joins at 2.3, the instant A's fifth step ends. C's prefill ends at 2.45, during
    # B's step, so decode admits it at that step's end (2.5).
    reqs = [SimRequest(Fraction(0), 10, 7), SimRequest(Fraction(0), 20, 3), SimRequest(Fraction(3, 10), 15, 2)]
    a, b, c = (r.timeline for r in simulate(reqs, prefill_spec(), decode_spec(), transfer))
    where = {"prefill_instance": "prefill-0", "decode_instance": "decode-0"}
    assert plain(a) == expected(
        0, 10, 7, 0.0, prefill_queued=0.0, prefill_start=0.0, prefill_end=1.3, prefill_batch_size=2,
        prefill_batch_tokens=30, handover=1.3, decode_admitted=1.3, migration_start=1.3, migration_end=1.8,
        steps=[(1.8, 1.9, 1), (1.9, 2.0, 1), (2.0, 2.1, 1), (2.1, 2.2, 1), (2.2, 2.3, 1), (2.3, 2.4, 2)],
        token_times=[1.3, 1.9, 2.0, 2.1, 2.2, 2.3, 2.4], finish=2.4, **where,
    )  # fmt: skip
    assert plain(b) == expected(
        1, 20, 3, 0.0, prefill_queued=0.0, prefill_start=0.0, prefill_end=1.3, prefill_batch_size=2,
        prefill_batch_tokens=30, handover=1.3, decode_admitted=1.3, migration_start=1.8, migration_end=2.3,
        steps=[(2.3, 2.4, 2), (2.4, 2.5, 1)], token_times=[1.3, 2.4, 2.5], finish=2.5, **where,
    )  # fmt: skip
    assert plain(c) == expected(
        2, 15, 2, 0.3, prefill_queued=0.3, prefill_start=1.3, prefill_end=2.45, prefill_batch_size=1,
        prefill_batch_tokens=15, handover=2.45, decode_admitted=2.5, migration_start=2.5, migration_end=3.0,
        steps=[(3.0, 3.1, 1)], token_times=[2.45, 3.1], finish=3.1, **where,
    )  # fmt: skip
    assert (a.ttft, a.tpot) == (Fraction(13, 10), Fraction(11, 10) / 6)


def test_token_mode_trace_by_hand():
    # The same requests in token mode: transfers run concurrently (A and B both land at 1.8) and
    # admission does not wait for a step to end (C is admitted at its hand-over).
    reqs = [SimRequest(Fraction(0), 10, 7), SimRequest(Fraction(0), 20, 3), SimRequest(Fraction(3, 10), 15, 2)]
    spec_p, spec_d = prefill_spec(block_size=None), decode_spec(block_size=None)
    assert all(r.timeline is None for r in simulate(reqs, spec_p, spec_d, transfer))
    a, b, c = (r.timeline for r in simulate(reqs, spec_p, spec_d, transfer, trace=True))
    where = {"prefill_instance": "prefill-0", "decode_instance": "decode-0"}
    assert plain(a) == expected(
        0, 10, 7, 0.0, prefill_queued=0.0, prefill_start=0.0, prefill_end=1.3, prefill_batch_size=2,
        prefill_batch_tokens=30, handover=1.3, decode_admitted=1.3, migration_start=1.3, migration_end=1.8,
        steps=[(1.8, 1.9, 2), (1.9, 2.0, 2), (2.0, 2.1, 1), (2.1, 2.2, 1), (2.2, 2.3, 1), (2.3, 2.4, 1)],
        token_times=[1.3, 1.9, 2.0, 2.1, 2.2, 2.3, 2.4], finish=2.4, **where,
    )  # fmt: skip
    assert plain(b) == expected(
        1, 20, 3, 0.0, prefill_queued=0.0, prefill_start=0.0, prefill_end=1.3, prefill_batch_size=2,
        prefill_batch_tokens=30, handover=1.3, decode_admitted=1.3, migration_start=1.3, migration_end=1.8,
        steps=[(1.8, 1.9, 2), (1.9, 2.0, 2)], token_times=[1.3, 1.9, 2.0], finish=2.0, **where,
    )  # fmt: skip
    assert plain(c) == expected(
        2, 15, 2, 0.3, prefill_queued=0.3, prefill_start=1.3, prefill_end=2.45, prefill_batch_size=1,
        prefill_batch_tokens=15, handover=2.45, decode_admitted=2.45, migration_start=2.45, migration_end=2.95,
        steps=[(2.95, 3.05, 1)], token_times=[2.45, 3.05], finish=3.05, **where,
    )  # fmt: skip


def colocated_spec(count=1, max_batch_tokens=64, num_blocks=100, block_size=16):
    return ColocatedInstanceSpec(count, batch_time, step_time, max_batch_tokens, 8, block_size, num_blocks)


def test_colocated_timeline_by_hand():
    # Prefill first: A's prefill 0-1.4; B and C (30 + 40 tokens) exceed the 64-token budget together, so B
    # runs alone 1.4-2.7 and C 2.7-4.1, while A waits for its second token until no prefill is left.
    reqs = [SimRequest(Fraction(0), 40, 3), SimRequest(Fraction(1, 2), 30, 2), SimRequest(Fraction(6, 10), 40, 3)]
    a, b, c = (r.timeline for r in simulate_colocated(reqs, colocated_spec()))
    where = {"prefill_instance": "colocated-0"}
    assert plain(a) == expected(
        0, 40, 3, 0.0, prefill_queued=0.0, prefill_start=0.0, prefill_end=1.4, prefill_batch_size=1,
        prefill_batch_tokens=40, steps=[(4.1, 4.2, 3), (4.2, 4.3, 2)], token_times=[1.4, 4.2, 4.3], finish=4.3,
        **where,
    )  # fmt: skip
    assert plain(b) == expected(
        1, 30, 2, 0.5, prefill_queued=0.5, prefill_start=1.4, prefill_end=2.7, prefill_batch_size=1,
        prefill_batch_tokens=30, steps=[(4.1, 4.2, 3)], token_times=[2.7, 4.2], finish=4.2, **where,
    )  # fmt: skip
    assert plain(c) == expected(
        2, 40, 3, 0.6, prefill_queued=0.6, prefill_start=2.7, prefill_end=4.1, prefill_batch_size=1,
        prefill_batch_tokens=40, steps=[(4.1, 4.2, 3), (4.2, 4.3, 2)], token_times=[4.1, 4.2, 4.3], finish=4.3,
        **where,
    )  # fmt: skip


def test_chunked_colocated_timeline_by_hand():
    # A 16-token budget per step. A's 40-token prompt runs in chunks of 16, 16 and 8 (0-1.16, 1.16-2.32,
    # 2.32-3.48); B (30 tokens, in at 0.5) is admitted with the 8 tokens left in A's last chunk step, then
    # runs 15 and 7 beside A's decode tokens (each step: step_time 0.1 plus its chunk's batch_time).
    reqs = [SimRequest(Fraction(0), 40, 3), SimRequest(Fraction(1, 2), 30, 2)]
    spec = dataclasses.replace(colocated_spec(max_batch_tokens=16), chunked_prefill=True)
    a, b = (r.timeline for r in simulate_colocated(reqs, spec))
    where = {"prefill_instance": "colocated-0"}
    assert plain(a) == expected(
        0, 40, 3, 0.0, prefill_queued=0.0, prefill_start=0.0, prefill_end=3.48, prefill_batch_size=2,
        prefill_batch_tokens=16, steps=[(3.48, 4.73, 2), (4.73, 5.9, 2)], token_times=[3.48, 4.73, 5.9],
        finish=5.9, **where,
    )  # fmt: skip
    assert plain(b) == expected(
        1, 30, 2, 0.5, prefill_queued=0.5, prefill_start=2.32, prefill_end=5.9, prefill_batch_size=2,
        prefill_batch_tokens=8, steps=[(5.9, 6.0, 1)], token_times=[5.9, 6.0], finish=6.0, **where,
    )  # fmt: skip


def test_colocated_routing_follows_prefill_work():
    # Prefill work decides, load only ties: A (10 prompt tokens, 200 out) goes to instance 0, B (100)
    # to instance 1, whose queue is A's prompt shorter. At 1.5 s A is prefilled (0-1.1) and decoding,
    # B still prefilling (0-2.0): C goes to instance 0, the more loaded (A's 210 tokens against B's
    # 102) but with no prompt to prefill.
    reqs = [SimRequest(Fraction(0), 10, 200), SimRequest(Fraction(0), 100, 2), SimRequest(Fraction(3, 2), 10, 2)]
    results = simulate_colocated(reqs, colocated_spec(count=2, max_batch_tokens=4096))
    assert [r.timeline.prefill_instance for r in results] == ["colocated-0", "colocated-1", "colocated-0"]
    c = results[2].timeline
    assert c.prefill_start == Fraction(3, 2)  # had it gone by load, it would have waited for B's prefill to end at 2.0


def test_decode_preemption_by_hand():
    # Decode has 2 blocks of 8 tokens. A and B (2-token prompts) are prefilled together (0-1.04) and each
    # admitted with one block; A is pulled 1.04-1.54, B 1.54-2.04. After the step 2.04-2.14 A has 9 tokens
    # and needs a second block: none is free, so B, the most recently admitted, is preempted (4 tokens).
    # A finishes at 2.44; only then can B be recomputed there: a prefill of its 4 tokens, 2.44-3.48.
    reqs = [SimRequest(Fraction(0), 2, 10), SimRequest(Fraction(0), 2, 5)]
    a, b = (r.timeline for r in simulate(reqs, prefill_spec(block_size=8), decode_spec(block_size=8, kv=16),
                                         transfer))  # fmt: skip
    where = {"prefill_instance": "prefill-0", "decode_instance": "decode-0"}
    a_steps = [(1.54, 1.64, 1), (1.64, 1.74, 1), (1.74, 1.84, 1), (1.84, 1.94, 1), (1.94, 2.04, 1),
               (2.04, 2.14, 2), (2.14, 2.24, 1), (2.24, 2.34, 1), (2.34, 2.44, 1)]  # fmt: skip
    assert plain(a) == expected(
        0, 2, 10, 0.0, prefill_queued=0.0, prefill_start=0.0, prefill_end=1.04, prefill_batch_size=2,
        prefill_batch_tokens=4, handover=1.04, decode_admitted=1.04, migration_start=1.04, migration_end=1.54,
        steps=a_steps, token_times=[1.04, *(end for _, end, _ in a_steps)], finish=2.44, **where,
    )  # fmt: skip
    assert plain(b) == expected(
        1, 2, 5, 0.0, prefill_queued=0.0, prefill_start=0.0, prefill_end=1.04, prefill_batch_size=2,
        prefill_batch_tokens=4, handover=1.04, decode_admitted=1.04, migration_start=1.54, migration_end=2.04,
        steps=[(2.04, 2.14, 2), (2.44, 3.48, 1), (3.48, 3.58, 1), (3.58, 3.68, 1)],
        token_times=[1.04, 2.14, 3.48, 3.58, 3.68], finish=3.68, num_preemptions=1, **where,
    )  # fmt: skip


def test_recompute_uses_the_decode_instances_own_prefill_time():
    reqs = [SimRequest(Fraction(0), 2, 10), SimRequest(Fraction(0), 2, 5)]
    spec = decode_spec(block_size=8, kv=16, batch_time=lambda lens: 2 * batch_time(lens))
    _, b = (r.timeline for r in simulate(reqs, prefill_spec(block_size=8), spec, transfer))
    assert b.steps[1] == (Fraction(244, 100), Fraction(244, 100) + Fraction(208, 100), 1)


def test_prefill_holds_kv_and_throttles_at_the_hold_fraction():
    # 10 blocks of 4 tokens, hold limit 5 blocks; one 8-token prompt (2 blocks) per batch of 1.08 s and
    # 5 s pulls one at a time. After three prefills 6 blocks are held, so the fourth prompt waits until
    # the first pull ends (6.08), although its blocks would fit.
    reqs = [SimRequest(Fraction(0), 8, 2) for _ in range(4)]
    spec = PrefillInstanceSpec(1, batch_time, None, 8, 40, 4, kv_hold_fraction=0.5)
    results = simulate(reqs, spec, decode_spec(), lambda tokens: Fraction(5))
    assert [float(r.timeline.prefill_start) for r in results] == [0.0, 1.08, 2.16, 6.08]
    assert [float(r.timeline.migration_start) for r in results] == [1.08, 6.08, 11.08, 16.08]


def test_block_mode_refuses_what_the_engine_cannot_run():
    with pytest.raises(ValueError, match="exceeds the smallest instance"):
        simulate([SimRequest(0.0, 10, 10)], prefill_spec(block_size=8), decode_spec(block_size=8, kv=16), transfer)
    with pytest.raises(ValueError, match="stage_time"):
        simulate([SimRequest(0.0, 10, 10)], PrefillInstanceSpec(1, batch_time, batch_time, 64, 640, 16),
                 decode_spec(), transfer)  # fmt: skip
    with pytest.raises(ValueError, match="block_size on both"):
        simulate([SimRequest(0.0, 10, 10)], prefill_spec(block_size=None), decode_spec(), transfer)


@pytest.mark.parametrize("tight", [False, True])
def test_block_mode_conserves_tokens(tight):
    rng = random.Random(3)
    n = 600
    reqs = [SimRequest(float(t), rng.randint(10, 300), rng.randint(1, 120)) for t in arrival_times(n, 20.0, seed=3)]
    results = simulate(
        reqs,
        PrefillInstanceSpec(2, lambda lens: 0.02 + 1e-4 * sum(lens), None, 1024, 4096, 16),
        DecodeInstanceSpec(2, lambda bs, ctx: 0.005 + 1e-6 * ctx, None, 64, 512 if tight else 100_000, 16),
        lambda tokens: 1e-4 * tokens,
    )
    by_decode = {}
    for req, res in zip(reqs, results):
        t = res.timeline
        assert len(t.token_times) == req.output_len and t.token_times[0] == t.prefill_end
        assert [end for _, end, _ in t.steps] == t.token_times[1:]
        assert all(a < b for a, b in zip(t.token_times, t.token_times[1:]))
        assert t.arrival == t.prefill_queued <= t.prefill_start < t.prefill_end == res.token_times[0]
        if req.output_len > 1:
            assert t.prefill_end == t.handover <= t.decode_admitted <= t.migration_start < t.migration_end
            assert t.migration_end <= t.steps[0][0]
            by_decode.setdefault(t.decode_instance, []).append((t.migration_start, t.migration_end))
    for pulls in by_decode.values():  # one pull at a time per decode instance
        pulls.sort()
        assert all(end <= start for (_, end), (start, _) in zip(pulls, pulls[1:]))
    preemptions = sum(r.timeline.num_preemptions for r in results)
    assert (preemptions > 0) == tight


def test_colocated_recomputes_conserve_tokens():
    rng = random.Random(4)
    reqs = [SimRequest(float(t), rng.randint(10, 300), rng.randint(1, 120)) for t in arrival_times(600, 20.0, seed=4)]
    spec = ColocatedInstanceSpec(2, lambda lens: 0.02 + 1e-4 * sum(lens), lambda bs, ctx: 0.005 + 1e-6 * ctx,
                                 1024, 64, 16, 40)  # fmt: skip
    results = simulate_colocated(reqs, spec)
    for req, res in zip(reqs, results):
        t = res.timeline
        assert len(t.token_times) == req.output_len and [end for _, end, _ in t.steps] == t.token_times[1:]
        assert t.handover is None and t.decode_instance is None
    assert sum(r.timeline.num_preemptions for r in results) > 0


def test_timeline_jsonl_round_trip(tmp_path):
    reqs = [SimRequest(0.0, 10, 7, "a"), SimRequest(0.0, 20, 3, "b"), SimRequest(0.3, 15, 1, "c")]
    timelines = [r.timeline for r in simulate(reqs, prefill_spec(), decode_spec(), lambda n: 0.5)]
    timelines[2].error = "refused"
    path = tmp_path / "timelines.jsonl"
    write_jsonl(path, timelines)
    assert read_jsonl(path) == timelines
    assert [t.request_id for t in read_jsonl(path)] == ["a", "b", "c"]
    assert timelines[2].tpot == 0.0 and timelines[2].handover is None
    with pytest.raises(ValueError, match="unknown timeline fields: extra"):
        RequestTimeline.from_json({**timelines[0].to_json(), "extra": 1})


def test_contention_stretches_batches_by_what_runs_beside_them():
    """Prefill 1 s, steps 0.25 s, pulls 0.5 s. Decode steps take 2x alone, 1x beside a prefill batch,
    3x during a pull into their instance; prefill batches 1.5x during a pull out of theirs. By hand:
    A prefills 0-1, B 1-2 (the pull of A starts at 1 too, after B's batch has begun); A's steps at
    1.5 and 1.75 run beside B's prefill; at 2 B's pull begins (to 2.5) and A's last step takes
    0.75 s; C's prefill starts at 2.25 during that pull: 1.5 s; B's step at 2.75 runs beside it;
    D, alone at 4, prefills to 5, is pulled to 5.5, and its step takes 0.5 s."""
    requests = [SimRequest(0.0, 10, 4), SimRequest(0.5, 10, 2), SimRequest(2.25, 10, 1), SimRequest(4.0, 10, 2)]
    prefill = PrefillInstanceSpec(1, lambda lens: 1.0, None, 4096, 1024, block_size=16,
                                  contention=Contention(during_pull=1.5))  # fmt: skip
    decode = DecodeInstanceSpec(1, lambda batch, context: 0.25, None, 256, 1024, block_size=16,
                                contention=Contention(alone=2.0, during_pull=3.0))  # fmt: skip
    a, b, c, d = (r.timeline for r in simulate(requests, prefill, decode, lambda tokens: 0.5))
    assert a.token_times == [1.0, 1.75, 2.0, 2.75] and (a.migration_start, a.migration_end) == (1.0, 1.5)
    assert (b.prefill_start, b.prefill_end, b.migration_start, b.migration_end) == (1.0, 2.0, 2.0, 2.5)
    assert b.steps == [(2.75, 3.0, 1)]
    assert (c.prefill_start, c.prefill_end, c.finish) == (2.25, 3.75, 3.75)
    assert d.token_times == [5.0, 6.0] and d.steps == [(5.5, 6.0, 1)]
