"""The roles without Ray: the prefill side's KV hold and the decode side's admission as state
machines, then a prefill engine and a decode engine in one process handing requests over through
an in-process KV transfer, greedy-equal to transformers."""

import time

import pytest
from conftest import assert_engine_idle, random_prompts, reference_greedy

from distserve import EngineConfig, Role, SamplingParams
from distserve.core.handover import Handover
from distserve.core.outputs import OutputBuilder, RequestOutput
from distserve.core.sequence import Sequence, SequenceStatus
from distserve.engine.decode_role import DecodeAdmission
from distserve.engine.kv_hold import KVHold
from distserve.engine.llm_engine import LLMEngine
from distserve.kv_transfer.plan import token_slots
from distserve.scheduling.block_manager import BlockManager

BLOCK = 4


def _handover(request_id: str, num_prompt: int, attempt: int = 0) -> Handover:
    prompt = list(range(3, 3 + num_prompt))
    params = SamplingParams(max_tokens=8, temperature=0.0)
    return Handover(request_id, attempt, "prefill-0", None, prompt, [7], params, 0, [0] * 8, BLOCK, num_prompt, 0)


def _held(bm: BlockManager, request_id: str, num_tokens: int, attempt: int = 0) -> Sequence:
    seq = Sequence(list(range(3, 3 + num_tokens)), SamplingParams(), request_id, attempt=attempt)
    bm.allocate(seq)
    return seq


# The prefill side's hold --------------------------------------------------------------------------


def test_hold_releases_only_the_run_it_holds():
    bm = BlockManager(16, BLOCK, enable_prefix_caching=False)
    hold = KVHold(timeout=10.0, limit_blocks=6)
    seq = _held(bm, "r", 10, attempt=1)  # 3 blocks
    hold.hold(seq, now=0.0)
    assert len(hold) == 1 and hold.num_blocks == 3 and not hold.full
    assert not hold.release("r", 0)  # an older run's pull: its KV is not what is held
    assert not hold.release("other", 1)
    assert hold.release("r", 1)
    assert len(hold) == 0 and hold.num_blocks == 3  # released, its blocks not yet freed
    assert not hold.release("r", 1)  # released once
    assert hold.take_released() == [seq] and hold.num_blocks == 0
    assert hold.take_released() == []


def test_hold_expires_at_its_deadline_and_refuses_a_late_release():
    bm = BlockManager(16, BLOCK, enable_prefix_caching=False)
    hold = KVHold(timeout=5.0, limit_blocks=6)
    early, late = _held(bm, "early", 8), _held(bm, "late", 8)
    hold.hold(early, now=0.0)
    hold.hold(late, now=3.0)
    assert hold.expire(now=5.0) == []  # not past the deadline yet
    assert hold.expire(now=5.5) == [early]
    assert not hold.release("early", 0)  # expired: the puller must not trust what it read
    assert hold.release("late", 0)


def test_hold_back_pressure_counts_held_blocks():
    bm = BlockManager(16, BLOCK, enable_prefix_caching=False)
    hold = KVHold(timeout=5.0, limit_blocks=4)
    first, second = _held(bm, "a", 8), _held(bm, "b", 4)
    hold.hold(first, now=0.0)
    assert not hold.full  # 2 of 4 blocks
    hold.hold(second, now=0.0)
    assert not hold.full  # 3 of 4
    third = _held(bm, "c", 2)
    hold.hold(third, now=0.0)
    assert hold.full
    assert hold.drop(first) and not hold.drop(first)
    assert not hold.full


# The decode side's admission ----------------------------------------------------------------------


def _admission(num_blocks: int, max_num_seqs: int = 8) -> tuple[BlockManager, DecodeAdmission]:
    bm = BlockManager(num_blocks, BLOCK, enable_prefix_caching=False)
    return bm, DecodeAdmission(bm, max_num_seqs)


def _add(admission: DecodeAdmission, request_id: str, num_prompt: int, attempt: int = 0) -> Sequence:
    handover = _handover(request_id, num_prompt, attempt)
    seq = Sequence.from_handover(handover)
    admission.add(seq, handover)
    return seq


def test_admission_in_arrival_order_as_blocks_allow():
    bm, admission = _admission(num_blocks=6)
    big = _add(admission, "big", 15)  # 16 tokens: 4 blocks
    small = _add(admission, "small", 3)  # 1 block
    bigger = _add(admission, "bigger", 11)  # 3 blocks: does not fit after the first two
    last = _add(admission, "last", 1)  # would fit, but does not overtake the head
    admitted = admission.admit(num_running=0)
    assert [seq for seq, _ in admitted] == [big, small]
    assert big.num_computed_tokens == 15 and bm.num_free_blocks == 1
    assert admission.num_waits == 1 and len(admission) == 4
    assert admission.admit(num_running=0) == [] and admission.num_waits == 1  # the same head: one wait
    assert admission.done(("big", 0), None) == (big, None)  # its KV arrived: it decodes now
    bm.free(big)  # ...and finishes
    assert [seq for seq, _ in admission.admit(num_running=0)] == [bigger, last]
    assert len(admission) == 3


def test_admission_respects_max_num_seqs():
    _, admission = _admission(num_blocks=64, max_num_seqs=3)
    seqs = [_add(admission, f"r{i}", 4) for i in range(4)]
    assert [seq for seq, _ in admission.admit(num_running=1)] == seqs[:2]
    assert admission.admit(num_running=1) == []
    assert admission.done(("r0", 0), None)[1] is None
    assert [seq for seq, _ in admission.admit(num_running=2)] == []  # r0 decodes now: 2 running + 1 pulling
    assert [seq for seq, _ in admission.admit(num_running=1)] == seqs[2:3]


def test_cancelled_while_pending_leaves_at_once_while_pulling_when_the_pull_ends():
    bm, admission = _admission(num_blocks=4)
    pulling = _add(admission, "pulling", 7)  # 2 blocks
    pending = _add(admission, "pending", 11)  # 3 blocks: waits
    admission.admit(num_running=0)
    assert admission.cancel(pending)  # gone now
    assert not admission.cancel(pulling)  # its blocks are being written
    assert len(admission) == 1 and bm.num_free_blocks == 2
    assert admission.done(("pulling", 0), None) == (pulling, "abort")
    assert len(admission) == 0 and admission.done(("pulling", 0), None) is None


def test_a_failed_pull_ends_with_an_error_and_runs_are_told_apart():
    _, admission = _admission(num_blocks=16)
    old = _add(admission, "r", 7, attempt=0)
    admission.admit(num_running=0)
    assert not admission.cancel(old)  # abandoned while pulling
    new = _add(admission, "r", 7, attempt=1)  # the re-run arrives before the old pull ends
    assert [seq for seq, _ in admission.admit(num_running=0)] == [new]
    assert admission.done(("r", 1), "the prefill instance is gone") == (new, "error")
    assert admission.done(("r", 0), None) == (old, "abort")


def test_a_pending_run_waits_and_an_admitted_one_pulls():
    _, admission = _admission(num_blocks=4)
    first, second = _add(admission, "first", 7), _add(admission, "second", 11)  # 2 blocks, then 3: waits
    assert first.status is second.status is SequenceStatus.WAITING
    admission.admit(num_running=0)
    assert (first.status, second.status) == (SequenceStatus.PULLING, SequenceStatus.WAITING)


# Engines in roles, with an in-process KV transfer ---------------------------------------------------


class InProcessPuller:
    """Copies a handed-over request's KV between two engines' caches in this process, when told."""

    def __init__(self, prefill: LLMEngine, decode: LLMEngine) -> None:
        self.prefill, self.decode = prefill, decode
        self.submitted: list[tuple[Handover, list[int]]] = []

    def submit(self, handover: Handover, block_table: list[int]) -> None:
        self.submitted.append((handover, block_table))

    def poll(self) -> list:
        return []  # pulls end when the test says so (``complete``)

    def complete(self) -> list:
        deltas = []
        for handover, table in self.submitted:
            src = token_slots(handover.block_table, handover.num_kv_tokens, handover.block_size)
            dst = token_slots(table, handover.num_kv_tokens, self.decode.block_manager.block_size)
            source = self.prefill.executor.worker.kv_cache.tensor
            self.decode.executor.worker.kv_cache.tensor[:, :, dst] = source[:, :, src]
            error = None if self.prefill.release_kv(handover.request_id, handover.attempt) else "KV no longer held"
            deltas += self.decode.pull_done(handover.request_id, handover.attempt, 1.0, 2.0, error)
        self.submitted.clear()
        return deltas


def make_engines(**options) -> tuple[LLMEngine, LLMEngine, InProcessPuller]:
    """A prefill and a decode engine of tiny-llama with different block sizes, and the transfer between them."""
    prefill = LLMEngine(
        EngineConfig.from_flat(
            model="tiny-llama", role="prefill", block_size=8, num_kv_blocks=64, **options, dtype="float32"
        )
    )
    decode = LLMEngine(
        EngineConfig.from_flat(
            model="tiny-llama", role="decode", block_size=BLOCK, num_kv_blocks=128, **options, dtype="float32"
        ),
        name="decode",
    )
    puller = InProcessPuller(prefill, decode)
    decode.kv_puller = puller
    return prefill, decode, puller


def serve(
    prefill, decode, puller, builders: dict[str, OutputBuilder], pull: bool = True, handed_on: set[str] | None = None
) -> dict[str, RequestOutput]:
    """Step both engines until every request has finished; the final outputs. ``handed_on``
    collects the ids of the requests handed from one to the other."""
    finals: dict[str, RequestOutput] = {}
    while len(finals) < len(builders):
        deltas = prefill.tick() + prefill.step() + decode.tick() + (puller.complete() if pull else []) + decode.step()
        for delta in deltas:
            output = builders[delta.request_id].add(delta)
            if delta.handover is not None:
                decode.add_handover(delta.handover)
                if handed_on is not None:
                    handed_on.add(delta.request_id)
            if output.finished:
                finals[delta.request_id] = output
    return finals


@pytest.fixture(scope="module")
def llama(reference_model):
    return reference_model("tiny-llama")


def check_hand_over(model, **options) -> None:
    """Requests prefilled by one engine and decoded by another end equal to ``model.generate``."""
    prefill, decode, puller = make_engines(**options)
    prompts = random_prompts([1, 5, 8, 17, 40, 64, 130], model.config.vocab_size, seed=2)
    builders = {}
    for i, prompt in enumerate(prompts):
        prefill.add_request(prompt, SamplingParams(max_tokens=12, temperature=0.0), f"r{i}")
        builders[f"r{i}"] = OutputBuilder(f"r{i}", None, prompt)
    finals = serve(prefill, decode, puller, builders)
    for i, prompt in enumerate(prompts):
        output = finals[f"r{i}"]
        assert output.output_token_ids == reference_greedy(model, prompt, 12)
        if len(output.output_token_ids) > 1:  # it went on past its first token: on decode
            assert output.metrics.migration_end == 2.0
    for engine in (prefill, decode):
        assert_engine_idle(engine)


def test_prefill_and_decode_engines_hand_over_to_the_greedy_output(llama):
    check_hand_over(llama)


def test_a_request_s_status_through_hand_over_admission_pull_and_finish():
    """Prefill: waiting, then held for decode after its first token. Decode: waiting for blocks,
    pulling once admitted, running once its KV is here, finished at its end."""
    prefill, decode, puller = make_engines()
    prefill.add_request(list(range(3, 30)), SamplingParams(max_tokens=4, temperature=0.0), "r")
    held = prefill.requests["r"][0]
    assert held.status is SequenceStatus.WAITING
    (delta,) = prefill.step()
    assert delta.handover is not None and held.status is SequenceStatus.HELD
    decode.add_handover(delta.handover)
    seq = decode.requests["r"][0]
    assert seq.status is SequenceStatus.WAITING
    decode.tick()
    assert seq.status is SequenceStatus.PULLING
    puller.complete()
    assert seq.status is SequenceStatus.RUNNING and decode.scheduler.running_seqs() == [seq]
    while "r" in decode.requests:
        decode.step()
    assert seq.status is SequenceStatus.FINISHED and seq.finish_reason == "length"
    prefill.tick()
    for engine in (prefill, decode):
        assert_engine_idle(engine)


def test_decode_cancelled_while_its_kv_arrives_frees_both_sides():
    prefill, decode, puller = make_engines()
    prefill.add_request(list(range(3, 40)), SamplingParams(max_tokens=12, temperature=0.0), "gone")
    (delta,) = prefill.step()
    decode.add_handover(delta.handover)
    decode.tick()
    assert len(puller.submitted) == 1 and decode.role.stats().num_pending == 1
    assert decode.abort_request("gone") == []  # its blocks are being written: it ends with the pull
    assert "gone" not in decode.requests
    (aborted,) = puller.complete()
    assert (aborted.request_id, aborted.finished, aborted.finish_reason) == ("gone", True, "abort")
    assert prefill.tick() == []  # the pull released it: prefill frees its blocks without a word
    for engine in (prefill, decode):
        assert_engine_idle(engine)


def test_kv_held_past_its_deadline_fails_the_request_and_the_pull():
    prefill, decode, puller = make_engines()
    prefill.kv_hold.timeout = 0.05
    prefill.add_request(list(range(3, 30)), SamplingParams(max_tokens=4, temperature=0.0), "late")
    (delta,) = prefill.step()
    decode.add_handover(delta.handover)
    decode.tick()
    time.sleep(0.1)
    (expired,) = prefill.tick()
    assert (expired.request_id, expired.finish_reason) == ("late", "error")
    (failed,) = puller.complete()  # the pull comes too late: the KV it read is not trusted
    assert (failed.request_id, failed.finish_reason) == ("late", "error")
    for engine in (prefill, decode):
        assert_engine_idle(engine)


def test_a_rerun_supersedes_an_abandoned_run_on_the_same_engine(llama):
    prefill, decode, puller = make_engines()
    prompt = random_prompts([33], llama.config.vocab_size, seed=5)[0]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    prefill.add_request(prompt, params, "r")
    (first,) = prefill.step()
    seq = prefill.make_sequence(prompt, params, "r", attempt=1)
    prefill.add_sequence(seq)  # the re-run replaces the held first run, freeing its blocks
    with pytest.raises(ValueError, match="already in use"):
        prefill.add_sequence(prefill.make_sequence(prompt, params, "r", attempt=1))
    builders = {"r": OutputBuilder("r", None, prompt)}
    (second,) = prefill.step()
    assert second.attempt == 1 and first.attempt == 0
    decode.add_handover(first.handover)  # the abandoned run reaches decode too...
    decode.add_handover(second.handover)  # ...and the later run replaces it there
    builders["r"].add(second)
    final = serve(prefill, decode, puller, builders)["r"]
    assert final.output_token_ids == reference_greedy(llama, prompt, 6)
    for engine in (prefill, decode):
        assert_engine_idle(engine)


def test_an_engine_changes_role_without_reloading(llama):
    prefill, decode, puller = make_engines()
    executor = prefill.executor
    prefill.change_role(Role.COLOCATED)
    assert prefill.executor is executor and prefill.block_manager.enable_prefix_caching
    prompt = random_prompts([50], llama.config.vocab_size, seed=7)[0]
    prefill.add_request(prompt, SamplingParams(max_tokens=10, temperature=0.0), "colocated")
    finals = serve(prefill, decode, puller, {"colocated": OutputBuilder("colocated", None, prompt)})
    assert finals["colocated"].output_token_ids == reference_greedy(llama, prompt, 10)
    decode.change_role(Role.PREFILL)
    assert decode.block_manager.enable_prefix_caching and decode.role.role is Role.PREFILL
    with pytest.raises(RuntimeError, match="only decode instances"):
        decode.add_handover(_handover("x", 4))
    assert_engine_idle(prefill)


def test_a_role_change_adopts_hands_on_and_gives_back_what_it_must(llama):
    """Colocated -> prefill hands decoding requests on with their whole KV and keeps the prompts
    not begun; colocated -> decode keeps decoding and gives back the prompts. Outputs stay greedy."""
    engine, decode, puller = make_engines(max_num_batched_tokens=64)
    engine.change_role(Role.COLOCATED)
    prompts = random_prompts([20, 30, 50, 90], llama.config.vocab_size, seed=11)
    builders = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, SamplingParams(max_tokens=16, temperature=0.0), f"r{i}")
        builders[f"r{i}"] = OutputBuilder(f"r{i}", None, prompt)
        if i == 1:  # r0 and r1 prefilled together, then two decode steps; r2 and r3 wait
            for _ in range(3):
                for delta in engine.step():
                    builders[delta.request_id].add(delta)
    finals = {}
    assert engine.scheduler.num_running == 2 and engine.scheduler.num_waiting == 2
    moved = engine.change_role(Role.PREFILL)
    assert sorted(d.request_id for d in moved) == ["r0", "r1"] and not any(d.finished for d in moved)
    for delta in moved:
        handover = delta.handover
        assert handover.num_kv_tokens == len(handover.prompt_token_ids) + len(handover.output_token_ids) - 1
        assert len(handover.output_token_ids) > 1 and handover.prefill_instance == engine.name
        decode.add_handover(handover)
    assert len(engine.kv_hold) == 2 and engine.scheduler.num_waiting == 2  # held for decode; prompts kept
    finals.update(serve(engine, decode, puller, builders))
    for i, prompt in enumerate(prompts):
        assert finals[f"r{i}"].output_token_ids == reference_greedy(llama, prompt, 16), f"r{i}"
    for e in (engine, decode):
        assert_engine_idle(e)

    other = LLMEngine(EngineConfig.from_flat(model="tiny-llama", block_size=8, num_kv_blocks=64, dtype="float32"))
    other.add_request(prompts[0], SamplingParams(max_tokens=16, temperature=0.0), "kept")
    kept = OutputBuilder("kept", None, prompts[0])
    (first,) = other.step()
    kept.add(first)
    other.add_request(prompts[1], SamplingParams(max_tokens=16, temperature=0.0), "back")
    (back,) = other.change_role(Role.DECODE)
    assert (back.request_id, back.finished, back.finish_reason) == ("back", True, "requeue")
    while "kept" in other.requests:
        for delta in other.step():
            output = kept.add(delta)
    assert output.output_token_ids == reference_greedy(llama, prompts[0], 16)
    assert_engine_idle(other)


def test_an_engine_gives_back_only_the_prompts_it_has_not_started(llama):
    """``give_back`` requeues a queued prompt of the named run; one begun (its first chunk ran)
    or of another run stays. What stays is served greedy-equal and nothing is left in use."""
    engine = LLMEngine(EngineConfig.from_flat(model="tiny-llama", block_size=8, num_kv_blocks=64, dtype="float32",
                                              enable_chunked_prefill=True, max_num_batched_tokens=16))  # fmt: skip
    prompts = random_prompts([40, 30, 20], llama.config.vocab_size, seed=13)
    builders = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, SamplingParams(max_tokens=8, temperature=0.0), f"r{i}")
        builders[f"r{i}"] = OutputBuilder(f"r{i}", None, prompt)
    assert engine.step() == []  # r0's first chunk: begun, no token yet
    given = engine.give_back([("r0", 0), ("r1", 0), ("r2", 1)])
    assert [(d.request_id, d.finished, d.finish_reason) for d in given] == [("r1", True, "requeue")]
    finals = {}
    while engine.requests:
        for delta in engine.step():
            finals[delta.request_id] = builders[delta.request_id].add(delta)
    for i in (0, 2):
        assert finals[f"r{i}"].output_token_ids == reference_greedy(llama, prompts[i], 8), f"r{i}"
    assert_engine_idle(engine)


@pytest.mark.parametrize("chunked", [False, True])
def test_a_prefill_role_can_finish_the_decoding_it_held_as_colocated(llama, chunked):
    """With ``finish_decoding_as_prefill``, colocated -> prefill hands nothing on at the change:
    the requests decoding go on here to their end, beside the new prompts, each of which is handed
    on after its first token. Outputs stay greedy, and nothing is left in use."""
    options = {"finish_decoding_as_prefill": True, "max_num_batched_tokens": 64, "enable_chunked_prefill": chunked}
    engine, decode, puller = make_engines(**options)
    engine.change_role(Role.COLOCATED)
    prompts = random_prompts([20, 30, 50, 90], llama.config.vocab_size, seed=12)
    builders = {}
    for i, prompt in enumerate(prompts[:2]):
        engine.add_request(prompt, SamplingParams(max_tokens=16, temperature=0.0), f"r{i}")
        builders[f"r{i}"] = OutputBuilder(f"r{i}", None, prompt)
    for _ in range(3):
        for delta in engine.step():
            builders[delta.request_id].add(delta)
    assert engine.scheduler.num_running == 2
    assert engine.change_role(Role.PREFILL) == [] and not len(engine.kv_hold)
    for i, prompt in enumerate(prompts[2:], start=2):
        engine.add_request(prompt, SamplingParams(max_tokens=16, temperature=0.0), f"r{i}")
        builders[f"r{i}"] = OutputBuilder(f"r{i}", None, prompt)
    handed_on = set()
    finals = serve(engine, decode, puller, builders, handed_on=handed_on)
    assert handed_on == {"r2", "r3"}  # r0 and r1 were decoded to their end where they were
    for i, prompt in enumerate(prompts):
        assert finals[f"r{i}"].output_token_ids == reference_greedy(llama, prompt, 16), f"r{i}"
    for e in (engine, decode):
        assert_engine_idle(e)


def test_kv_held_for_decode_is_decoded_in_place_once_its_holder_is_colocated(llama):
    """A hand-over that comes back to the instance holding its KV (it left prefill for colocated
    while the hand-over was on its way, and no decode instance is left) decodes there, no pull."""
    prefill, _, _ = make_engines()
    prompt = random_prompts([40], llama.config.vocab_size, seed=13)[0]
    prefill.add_request(prompt, SamplingParams(max_tokens=10, temperature=0.0), "held")
    builder = OutputBuilder("held", None, prompt)
    (first,) = prefill.step()
    builder.add(first)
    assert prefill.change_role(Role.COLOCATED) == [] and len(prefill.kv_hold) == 1
    prefill.add_handover(first.handover)
    assert len(prefill.kv_hold) == 0 and prefill.scheduler.num_running == 1
    while "held" in prefill.requests:
        for delta in prefill.step():
            output = builder.add(delta)
    assert output.output_token_ids == reference_greedy(llama, prompt, 10)
    assert_engine_idle(prefill)


def test_a_run_pulled_away_comes_back_before_the_next_tick_and_is_taken_over(llama):
    # Prefill held x; decode pulled it (the hold released, the prefill engine not ticked since),
    # decoded a token and left decode, handing x on to the former prefill engine, now decoding.
    prompt = list(range(3, 40))
    prefill, decode, puller = make_engines()
    prefill.add_request(prompt, SamplingParams(max_tokens=12, temperature=0.0), "x")
    (first,) = prefill.step()
    decode.add_handover(first.handover)
    decode.tick()
    puller.complete()
    (second,) = decode.step()
    prefill.change_role("decode")
    (back,) = decode.change_role("prefill")
    prefill.kv_puller = InProcessPuller(decode, prefill)
    prefill.add_handover(back.handover)  # the released hold goes first: no "already in use"
    prefill.tick()
    prefill.kv_puller.complete()
    tokens = first.new_token_ids + second.new_token_ids
    while prefill.has_unfinished_requests():
        tokens += [t for d in prefill.tick() + prefill.step() for t in d.new_token_ids]
    decode.tick()
    assert tokens == reference_greedy(llama, prompt, 12)
    assert_engine_idle(prefill)
    assert_engine_idle(decode)
