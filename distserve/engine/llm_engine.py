"""The engine core of one instance: validate and queue requests, then step, one batch at a time:
schedule (its one scheduler, under its role's policy), execute (the executor and the sampler),
update (tokens, stops, hand-overs). It emits each step's deltas; the offline ``LLM`` and the
orchestrator add them up into outputs."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from distserve.core.config import EngineConfig
from distserve.core.errors import RequestError, RequestFault
from distserve.core.handover import HandedSample, Handover
from distserve.core.outputs import STAGE_FIELDS, RequestDelta, TokenLogprobs
from distserve.core.role import Role
from distserve.core.sampling_params import SamplingParams
from distserve.core.sequence import Sequence, SequenceStatus
from distserve.core.step_metrics import StepRecord, StepStats, StepTimer
from distserve.engine.beam_search import BeamSearch
from distserve.engine.decode_role import DecodeRole, KVPuller
from distserve.engine.detokenizer import Detokenizer, find_stop_string
from distserve.engine.executor import Executor, make_executor
from distserve.engine.input_processor import InputProcessor
from distserve.engine.kv_hold import KVHold
from distserve.engine.prefill_role import PrefillRole
from distserve.engine.role import ColocatedRole, InstanceRole, RoleContext
from distserve.kv_connector.base import KVConnectorScheduler
from distserve.kv_connector.swap import SwapConnector
from distserve.kv_connector.tier import TierConnector
from distserve.kv_transfer.plan import KVSource
from distserve.model_executor.model_loader import default_sampling_params, eos_token_ids, load_tokenizer, resolve_model
from distserve.model_executor.model_runner import BatchInput, SeqInput
from distserve.model_executor.token_bitmask import allocate_bitmask
from distserve.model_executor.worker import ModelOutput
from distserve.parallel.ranks import check_parallel_config
from distserve.scheduling.block_manager import BlockManager
from distserve.scheduling.scheduler import ScheduledBatch, Scheduler
from distserve.scheduling.step_time import StepTimeModel
from distserve.scheduling.swap import SwapSpace

if TYPE_CHECKING:
    from distserve.kv_tier.client import TierClient

logger = logging.getLogger(__name__)

ROLE_CLASSES: dict[Role, type[InstanceRole]] = {
    Role.COLOCATED: ColocatedRole,
    Role.PREFILL: PrefillRole,
    Role.DECODE: DecodeRole,
}


class LLMEngine:
    """One instance's requests, scheduler and output processing, in the role it plays; the model
    runs in its executor.

    ``make_kv_puller`` builds, from the executor, what pulls handed-over KV into this engine's
    blocks in a decode role (the instance's migrator); without one, a decode role refuses to admit
    a hand-over."""

    def __init__(
        self,
        config: EngineConfig,
        max_step_records: int = 0,
        name: str = "engine",
        make_kv_puller: Callable[[Executor], KVPuller] | None = None,
    ) -> None:
        self.config = config
        self.name = name
        resolved = resolve_model(config.model)
        check_parallel_config(resolved.hf_config, resolved.shape, config.parallel)
        self.tokenizer = load_tokenizer(resolved)
        self.max_model_len = resolved.max_model_len
        self.vocab_size = resolved.shape.vocab_size
        self.eos_token_ids = eos_token_ids(resolved, self.tokenizer)
        max_tokens = config.scheduler.max_num_seqs * self.max_model_len
        self.executor = make_executor(config, max_tokens, name)
        num_blocks = self.executor.num_blocks
        self.block_manager = BlockManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.tier: TierClient | None = None  # the node's prefix tier, once attached
        self.detokenizer = Detokenizer(self.tokenizer)
        self.input_processor = InputProcessor(
            self.tokenizer, self.vocab_size, self.max_model_len, num_blocks, config.cache.block_size,
            self.eos_token_ids, default_sampling_params(resolved, config.model.generation_config),
        )  # fmt: skip
        # Every request this engine has, by id (one run each), and its samples here by index.
        self.requests: dict[str, dict[int, Sequence]] = {}
        self.beam_searches: dict[str, BeamSearch] = {}  # the beam searches among them, by request id
        self.stats = StepStats(max_step_records)
        self.step_time = StepTimeModel()  # kept across role changes: the machine and model stay
        # The batch on the executor now: (time.monotonic() it began, its tokens), None between
        # batches; and the most seconds per token a step has taken, so that a stalled step can be
        # told apart from a long one (``Instance.get_outputs``).
        self.executing: tuple[float, int] | None = None
        self.slowest_per_token = 0.0
        # One scheduler for the engine's life: a role change changes its mode, not its queues.
        swap = None
        if self.executor.num_swap_blocks:
            swap = SwapSpace(self.executor.num_swap_blocks, self.block_manager, self.step_time)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.step_time, swap=swap)
        # What each step moves into and out of the KV cache, in the order of their loads: swap's
        # copies out first (a block they free may be allocated, and loaded into, in the same step).
        self.kv_connectors: list[KVConnectorScheduler] = [SwapConnector(swap)] if swap is not None else []
        scheduler = config.scheduler
        self.kv_hold = KVHold(scheduler.kv_hold_timeout, max(1, int(scheduler.kv_hold_fraction * num_blocks)))
        self._set_role(scheduler.role)
        self._warm_up()
        self.kv_puller = make_kv_puller(self.executor) if make_kv_puller is not None else None
        self.kv_source: KVSource | None = None  # how a decode instance reaches this one's KV, carried in its hand-overs

    def _warm_up(self) -> None:
        """Run one decode step of two throw-away sequences, so that its one-time costs (with the
        compiled attention backend, building its kernel: one to five seconds on CPU) are paid now
        and not inside the first request's latency. They write the first slot of block 0, which
        holds nothing yet."""
        params = SamplingParams(max_tokens=1, temperature=0.0)
        seqs = [SeqInput([0], 0, [0], params, output_index=0) for _ in range(2)]
        self.executor.execute_model(BatchInput(is_prefill=False, seqs=seqs, num_decode=len(seqs)))

    def _set_role(self, role: Role, finishing: bool = False) -> None:
        """Play ``role``: its role object and the step mode of the scheduler."""
        context = RoleContext(self.name, self.config.scheduler, self.scheduler, self.kv_hold)
        role_class = ROLE_CLASSES[role]
        self.role = role_class(context, finishing=True) if finishing else role_class(context)
        self.scheduler.set_mode(self.role.step_mode)

    def change_role(self, role: Role | str) -> list[RequestDelta]:
        """Play ``role`` from now on, keeping the weights, the KV cache, the executor and the
        scheduler's queues; call between steps, once ``role.ready_to_leave()``. The requests the new
        role can serve stay where they are; the others leave with a delta: a decoding request the
        new role cannot decode is handed on with its KV (the delta carries the hand-over), unless
        ``finish_decoding_as_prefill`` has the new prefill role decode it to its end here, and one
        it cannot run here at all (a prompt a decode role will not prefill, a prompt part-way
        through its chunks, a preempted request a prefill role cannot decode) ends with
        ``finish_reason="requeue"``, to run elsewhere."""
        role = Role.parse(role)
        new_class = ROLE_CLASSES[role]
        finish_here = new_class.decodes or self.config.scheduler.finish_decoding_as_prefill
        if not self.role.ready_to_leave():
            raise RuntimeError(f"{self.name} is still taking requests over: it cannot leave {self.role.role} yet")
        requeued, deltas, finishing = [], [], False
        for seq in self.scheduler.waiting_seqs():
            can_run = new_class.decodes if seq.num_output_tokens else new_class.takes_prompts and not seq.block_table
            if not can_run:
                requeued.append(seq)
        for seq in self.scheduler.running_seqs():
            if not seq.num_output_tokens or seq.num_computed_tokens < seq.num_tokens - 1:
                requeued.append(seq)  # part-way through its prompt's (or a recompute's) chunks
            elif finish_here:
                finishing = True  # it decodes on here
            elif seq.num_samples > 1 or seq.beams is not None:
                requeued.append(seq)  # its samples (beams) hold their KV apart: they cross as a new run
            else:
                self.scheduler.finish_running(seq)  # its blocks go to the hold, not back to the pool
                deltas.append(self._delta(seq, [], "", self.hand_off(seq)))
        deltas += [self.finish(seq, "requeue") for seq in requeued]
        self.config = dataclasses.replace(self.config, scheduler=dataclasses.replace(self.config.scheduler, role=role))
        self._set_role(role, finishing=finishing and not new_class.decodes)
        logger.info("%s is a %s instance now", self.name, role)
        return deltas

    def attach_tier(self, client: TierClient) -> None:
        """Use the node's prefix tier (``client``'s store): look prompts up there, save blocks there."""
        self.executor.attach_tier(client.geometry, client.shared)
        self.tier = client
        self.block_manager.tier = connector = TierConnector(self.block_manager, client)
        self.kv_connectors.append(connector)

    def shutdown(self) -> None:
        self.executor.shutdown()

    # Requests -----------------------------------------------------------------------------

    def make_sequence(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        attempt: int = 0,
        ttft_deadline: float | None = None,
        tpot_slo: float | None = None,
    ) -> Sequence:
        """Validate a request and build its sequence; raises RequestError saying what to fix."""
        return self.input_processor.process(prompt, params, request_id, priority, attempt, ttft_deadline, tpot_slo)

    def register(self, seq: Sequence, sibling: bool = False) -> None:
        """Track ``seq`` and start its detokenization (past any output it already has). A later run
        of a request replaces an earlier one still here; the same run twice is refused, but for
        the ``sibling`` samples of one."""
        # A run pulled from here since the last tick may come back (this engine decodes now, and the
        # decode instance that pulled it left decode): it is gone from here first.
        self._free_released()
        samples = self.requests.get(seq.request_id)
        if samples and not sibling:
            current = next(iter(samples.values()))
            if current.attempt >= seq.attempt:
                raise RequestError(f"request id '{seq.request_id}' is already in use")
            self.abort_request(seq.request_id, current.attempt)
        if seq.beams is None:  # a beam search detokenizes its hypotheses once, at its end
            self.detokenizer.start(seq)
            if seq.num_output_tokens:  # handed over: its text so far, of which num_text_sent was sent
                self.detokenizer.step(seq)
        structured = seq.sampling_params.structured_outputs
        if structured is not None and seq.grammar is None:  # its place in the grammar, from its tokens
            seq.grammar = self.input_processor.grammars.matcher(structured, seq.output_token_ids)
        self.requests.setdefault(seq.request_id, {})[seq.sample_index] = seq

    def add_sequence(self, seq: Sequence, local_prefill: bool = False) -> None:
        """Queue a new request from its prompt; ``local_prefill``: a decode role's own to prefill."""
        seq.metrics.prefill_queued = time.time()
        self.register(seq)
        if seq.sampling_params.beam_width is not None:
            self.beam_searches[seq.request_id] = BeamSearch(seq.sampling_params, seq.num_prompt_tokens,
                                                            self.max_model_len, [seq])  # fmt: skip
        try:
            self.role.add(seq, local_prefill)
        except BaseException:
            self.forget(seq)
            raise

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
    ) -> str:
        seq = self.make_sequence(prompt, params, request_id, priority)
        self.add_sequence(seq)
        return seq.request_id

    def add_handover(self, handover: Handover) -> None:
        """Decode: take a prefilled request over; it decodes once its KV has been pulled. A request
        this engine holds itself (it changed role since, to decode or colocated) decodes from its
        blocks here at once, unless its end came already (its hold expired, or it was aborted)."""
        if handover.prefill_instance == self.name:
            if seq := self.kv_hold.take(handover.request_id, handover.attempt):
                self.role.adopt(seq)
            return
        seq = Sequence.from_handover(handover)
        siblings = [Sequence.from_handover(handover, sample) for sample in handover.siblings]
        self.role.add_handover(seq, handover, siblings)  # a role that takes none over refuses it here
        try:
            self.register(seq)
            for sibling in siblings:
                self.register(sibling, sibling=True)
            if handover.beams is not None:
                self.beam_searches[seq.request_id] = BeamSearch(
                    handover.sampling_params, handover.num_prompt_tokens, self.max_model_len, [seq, *siblings],
                    handover.beams,
                )  # fmt: skip
        except BaseException:
            self.role.cancel(seq)
            raise

    def hand_off(self, seq: Sequence, siblings: list[Sequence] = ()) -> Handover:
        """Hold ``seq``'s KV for a decode instance to pull, and the hand-over that says where it is.
        The caller has taken ``seq`` out of its scheduler; the hold frees its blocks after the pull.
        ``siblings``, samples of the same request at the end of its prompt (or beams after the first
        step of its beam search), share its KV: they go with it, and leave here now."""
        search = self.beam_searches.get(seq.request_id)
        self.kv_hold.hold(seq, time.monotonic())
        for sibling in siblings:
            self.block_manager.free(sibling)
            self.forget(sibling)
        return Handover(
            seq.request_id,
            seq.attempt,
            self.name,
            seq.prompt,
            seq.prompt_token_ids,
            seq.output_token_ids,
            seq.request_params,
            seq.priority,
            list(seq.block_table),
            self.block_manager.block_size,
            seq.num_computed_tokens,
            seq.num_text_sent,
            seq.tpot_slo,
            seq.sample_index,
            [HandedSample(s.sample_index, s.output_token_ids, s.num_text_sent) for s in siblings],
            self.kv_source,
            search.state if search is not None else None,
        )

    def release_kv(self, request_id: str, attempt: int) -> bool:
        """A decode instance has pulled this run's held KV, which can go; False when it went already
        (at the hold deadline, or aborted), so what was pulled cannot be trusted. Safe from any thread."""
        return self.kv_hold.release(request_id, attempt)

    def pull_done(
        self, request_id: str, attempt: int, start: float | None, end: float | None, error: str | None
    ) -> list[RequestDelta]:
        """Decode: a run's KV pull ended (``error`` None: it arrived); the deltas that follow."""
        outcome = self.role.pull_done(request_id, attempt, start, end, error)
        if outcome is None or outcome.finish_reason is None:
            return []
        return [self.finish(seq, outcome.finish_reason) for seq in outcome.samples]

    def abort_request(self, request_id: str, attempt: int | None = None, reason: str = "abort") -> list[RequestDelta]:
        """Stop a request (``attempt``: only that run) wherever it is, every sample of it, and free
        their blocks; their final deltas, none for a sample whose end comes later (KV still arriving).

        ``reason`` is "abort" when a client cancels, "error" when the request cannot go on here.
        """
        samples = list(self.requests.get(request_id, {}).values())
        deltas = []
        for seq in samples:
            if (attempt is not None and seq.attempt != attempt) or seq.is_finished:
                continue  # finished: a sibling whose carrier's failed pull ended it already
            if self.role.cancel(seq):
                deltas.append(self.finish(seq, reason))
            else:
                self.forget(seq)  # its id is free for a re-run; the end of its KV pull finishes it
        return deltas

    def give_back(self, runs: list[tuple[str, int]]) -> list[RequestDelta]:
        """End with ``finish_reason="requeue"``, to run elsewhere, those of these runs (request id,
        attempt) whose prompts wait here unstarted; the others stay."""
        unstarted = {
            seq.request_id: seq
            for seq in self.scheduler.waiting_seqs()
            if not seq.num_output_tokens and not seq.block_table
        }
        given = [seq for request_id, attempt in runs if (seq := unstarted.get(request_id)) and seq.attempt == attempt]
        return [self.finish(seq, "requeue") for seq in given]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def tick(self) -> list[RequestDelta]:
        """Housekeeping between steps: held KV pulled (freed: the request goes on elsewhere) or past
        its deadline (failed), then the role's own (decode: admissions, whose pulls start at once,
        and the pulls that ended since, whose requests join the batch)."""
        self._free_released()
        deltas = [self.finish(seq, "error") for seq in self.kv_hold.expire(time.monotonic())]
        admitted = self.role.admit()
        if admitted and self.kv_puller is None:
            raise RuntimeError(f"{self.name}: a decode engine needs a KV puller to take requests over")
        for seq, handover in admitted:
            self.kv_puller.submit(handover, list(seq.block_table))
        if self.kv_puller is not None:
            for end in self.kv_puller.poll():
                start, stop = (end.record.start, end.record.end) if end.record is not None else (None, None)
                deltas += self.pull_done(end.request_id, end.attempt, start, stop, end.error)
        return deltas

    def _free_released(self) -> None:
        """Free the held KV that decode instances have pulled: those requests go on elsewhere."""
        for seq in self.kv_hold.take_released():
            self.forget(seq)
            self.block_manager.free(seq)

    def finish(self, seq: Sequence, reason: str) -> RequestDelta:
        """End ``seq`` with ``reason``, free its blocks; its final delta."""
        self._finish(seq, reason)
        return self._delta(seq, [], "")

    def forget(self, seq: Sequence) -> None:
        samples = self.requests.get(seq.request_id, {})
        if samples.get(seq.sample_index) is seq:
            del samples[seq.sample_index]
            if not samples:
                del self.requests[seq.request_id]
                self.beam_searches.pop(seq.request_id, None)

    # Stepping -----------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        """Run one batch: schedule, execute, update; returns a delta for every sequence that advanced."""
        timer = StepTimer()
        batch = self.scheduler.schedule() if self.role.may_schedule() else ScheduledBatch([], is_prefill=True)
        timer.lap("schedule")
        if not batch.seqs:  # what the connectors have to move waits for a step that runs
            return []
        model_input, output = self._execute(batch, timer)
        deltas = self._update(batch, model_input, output)
        timer.lap("postprocess")
        record = StepRecord(batch.is_prefill, len(batch.seqs), model_input.num_tokens, timer.seconds)
        self.stats.add(record)
        self.step_time.observe(record.num_tokens, record.total)
        self.slowest_per_token = max(self.slowest_per_token, record.total / max(1, record.num_tokens))
        return deltas

    def _execute(self, batch: ScheduledBatch, timer: StepTimer) -> tuple[BatchInput, ModelOutput]:
        """Run ``batch`` on the executor and note when its sequences ran."""
        model_input = BatchInput.from_sequences(batch.is_prefill, batch.seqs, batch.num_decode, batch.num_new_tokens)
        model_input.block_copies, self.block_manager.pending_copies = self.block_manager.pending_copies, []
        moves = [(c, meta) for c in self.kv_connectors if (meta := c.build_connector_meta()) is not None]
        model_input.kv_connectors = [meta for _, meta in moves]
        faults = self._constrain(batch.seqs, model_input.seqs)
        started = time.time()
        self.executing = (time.monotonic(), model_input.num_tokens)
        try:
            output = self.executor.execute_model(model_input)
        finally:
            self.executing = None
        timer.lap("execute")
        output.faults = {**faults, **output.faults}
        for connector, meta in moves:  # the copies' time on the driver rank: swap's cost per block
            connector.update_connector_output(meta, output.seconds.get(meta.connector, 0.0))
        ended = time.time()
        step = (started, ended, len(batch.seqs))
        for seq in batch.seqs:
            metrics = seq.metrics
            if seq.num_output_tokens:  # decoding, or a recompute after preemption
                metrics.steps.append(step)
            else:  # its first prefill (over several steps when chunked); a decode instance never sees one
                metrics.prefill_start = metrics.prefill_start or started
                metrics.prefill_end = ended
                metrics.prefill_batch_size, metrics.prefill_batch_tokens = len(batch.seqs), model_input.num_tokens
        # Split the executor's time into the driver rank's phases and the rest (calls, transfers).
        timer.seconds["dispatch"] = timer.seconds.pop("execute") - sum(output.seconds.values())
        timer.seconds.update(output.seconds)
        return model_input, output

    def _update(self, batch: ScheduledBatch, model_input: BatchInput, output: ModelOutput) -> list[RequestDelta]:
        """Give each sequence of ``batch`` what it computed: a token (which may end it or hand it
        on), or the progress of a prompt chunk. A request whose part of the step failed, there or
        on the executor (``output.faults``), ends alone with its fault; the others go on."""
        logprobs = output.logprobs or [None] * len(output.sampled_token_ids)
        deltas, start = [], 0
        for i, (seq, seq_input) in enumerate(zip(batch.seqs, model_input.seqs)):
            count = (1 + len(seq_input.sibling_params or ())) if seq_input.sample else 0
            tokens, token_logprobs = output.sampled_token_ids[start : start + count], logprobs[start : start + count]
            start += count
            if seq.is_finished:  # a sample of its request failed earlier in this step, and it ended with it
                continue
            fault = output.faults.get(i)
            if fault is None:
                try:
                    deltas += self._advance(seq, seq_input, tokens, token_logprobs, output, i, batch)
                    continue
                except Exception as e:
                    logger.exception("%s: its output failed to be processed", seq.request_id)
                    fault = RequestFault.of("output processing", e)
            deltas += self._fail_request(seq, fault)
        return deltas

    def _advance(
        self,
        seq: Sequence,
        seq_input: SeqInput,
        tokens: list[int],
        logprobs: list[TokenLogprobs | None],
        output: ModelOutput,
        i: int,
        batch: ScheduledBatch,
    ) -> list[RequestDelta]:
        """``seq``'s part of the step (the ``i``-th of ``batch``): its ``tokens``, or its prompt chunk."""
        if output.prompt_logprobs and output.prompt_logprobs[i]:
            seq.prompt_logprobs += output.prompt_logprobs[i]
        if seq_input.beam_candidates:
            if seq_input.start + len(seq_input.input_token_ids) < seq.num_tokens:
                return []  # a sibling's report earlier in this step moved the search on: this one is stale
            return self._beam_step(seq, output.beam_candidates[i])
        if seq_input.sibling_params:
            return self._start_samples(seq, tokens, logprobs)
        if seq_input.sample:
            after_prefill = batch.is_prefill and i >= batch.num_decode
            return [self._append_token(seq, tokens[0], after_prefill, logprobs[0])]
        seq.num_computed_tokens += len(seq_input.input_token_ids)  # a prompt chunk short of the prompt's end
        return []

    def _fail_request(self, seq: Sequence, fault: RequestFault) -> list[RequestDelta]:
        """End ``seq``'s run, every sample of it, with ``fault``, freeing their blocks: its own part
        of a step failed. Their final deltas carry the fault, which the orchestrator ends the
        request with rather than run it again (it would fail the same way anywhere)."""
        fault = fault.of_request(seq.request_id)
        logger.error("%s: %s; it ends here, the instance goes on", self.name, fault)
        deltas = self.abort_request(seq.request_id, seq.attempt, reason="error")
        if not deltas:  # every sample had ended already, or ends later (its KV arriving): say it now
            deltas = [RequestDelta(seq.request_id, seq.attempt, [], "", True, "error", 0, index=seq.sample_index)]
        for delta in deltas:
            delta.fault = fault
        return deltas

    def _start_samples(
        self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprobs | None]
    ) -> list[RequestDelta]:
        """The end of the prompt of a request of n samples: fork its other samples from ``seq``,
        sharing its blocks, give each its first token, and let the role take those that go on
        (decode them here, or hand them over with one copy of the prompt's KV)."""
        samples = [seq]
        for index in range(1, seq.num_samples):
            sample = seq.fork(index)
            self.block_manager.fork(seq, sample)
            self.register(sample, sibling=True)
            samples.append(sample)
        deltas = [self._append_token(s, token, False, lp) for s, token, lp in zip(samples, tokens, logprobs)]
        for delta in deltas:
            delta.first = True
        going_on = [(s, d) for s, d in zip(samples, deltas) if not s.is_finished]
        if going_on and self.role.after_prefill_samples(seq, [s for s, _ in going_on]):
            carrier, *siblings = (s for s, _ in going_on)
            going_on[0][1].handover = self.hand_off(carrier, siblings)
        return deltas

    def _beam_step(self, seq: Sequence, candidates: tuple[list[int], list[float]]) -> list[RequestDelta]:
        """A beam's candidates for its next token. Once all of its request's beams have theirs, one
        step of the search: the beams that go on are forked (sharing blocks) or kept, the others
        dropped, their blocks freed; at the search's end, its best hypotheses' final deltas."""
        search = self.beam_searches[seq.request_id]
        seq.num_computed_tokens = seq.num_tokens - 1  # it runs its newest token again until the step selects
        if not search.report(seq, *candidates):
            return []
        at_prompt_end = not seq.num_output_tokens
        selected, done = search.select()
        if done:
            return self._end_beam_search(search)
        beams = self._continue_beams(search, selected)
        if not at_prompt_end:
            for beam in beams:
                if beam.status is not SequenceStatus.RUNNING:  # forked from a running beam: new here
                    beam.status = SequenceStatus.RUNNING
                    self.scheduler.running.add(beam)
            return []
        # After the prompt: the role runs the forks beside the prompt's sequence, or hands them all over.
        if self.role.after_prefill_samples(seq, beams):
            carrier, *siblings = beams
            handover = self.hand_off(carrier, siblings)
            return [RequestDelta(seq.request_id, seq.attempt, [], "", False, None, seq.num_cached_tokens, handover,
                                 tuple(getattr(seq.metrics, name) for name in STAGE_FIELDS))]  # fmt: skip
        return []

    def _continue_beams(self, search: BeamSearch, selected: list[tuple[Sequence, int]]) -> list[Sequence]:
        """The next beams of ``search``: each (parent, token) of ``selected`` continues its parent's
        sequence, or a fork of it when the parent goes on already; parents that do not go on are
        dropped, and their blocks freed."""
        kept: set[int] = set()
        beams = []
        for parent, token in selected:
            if parent.seq_id in kept:
                beam = parent.fork(search.next_index())
                beam.status = SequenceStatus.WAITING  # not in the scheduler yet
                self.block_manager.fork(parent, beam)
                self.register(beam, sibling=True)
            else:
                kept.add(parent.seq_id)
                beam = parent
            beams.append((beam, token))
        for old in search.beams:
            if old.seq_id not in kept:
                self._finish(old, "stop")  # a dropped beam: no output of its own
        for beam, token in beams:
            beam.append_token(token)
            beam.num_computed_tokens = beam.num_tokens - 1
        search.beams[:] = [beam for beam, _ in beams]
        return search.beams

    def _end_beam_search(self, search: BeamSearch) -> list[RequestDelta]:
        """Free every beam of ``search`` and return its ``n`` best hypotheses as final deltas."""
        first = search.beams[0]
        request_id, attempt, metrics = first.request_id, first.attempt, first.metrics
        cached, preemptions = first.num_cached_tokens, sum(b.num_preemptions for b in search.beams)
        prompt, params = first.prompt_token_ids, first.sampling_params
        for beam in list(search.beams):
            self._finish(beam, "stop")
        best = search.best()
        if len(best) < params.n:
            raise RuntimeError(f"beam search ended with {len(best)} hypotheses, fewer than n={params.n}")
        stages = tuple(getattr(metrics, name) for name in STAGE_FIELDS)
        return [
            RequestDelta(
                request_id,
                attempt,
                hyp.token_ids,
                self.detokenizer.text_of(prompt, hyp.token_ids, params.skip_special_tokens),
                True,
                hyp.finish_reason,
                cached,
                None,
                stages,
                metrics.steps,
                preemptions,
                first=True,
                index=j,
                samples_left=len(best) - 1 - j,
                cumulative_logprob=hyp.cumulative_logprob,
                beam_score=hyp.score,
            )
            for j, hyp in enumerate(best)
        ]

    def _constrain(self, seqs: list[Sequence], inputs: list[SeqInput]) -> dict[int, RequestFault]:
        """Give each sampling input of a constrained request its row of the grammar's bitmask; the
        faults of those whose grammar raised, by index (their rows go unconstrained: their tokens
        are not used)."""
        constrained = [(i, seq) for i, (seq, s) in enumerate(zip(seqs, inputs)) if seq.grammar is not None and s.sample]
        faults = {}
        if not constrained:
            return faults
        bitmask = allocate_bitmask(len(constrained), self.vocab_size)
        for row, (i, seq) in enumerate(constrained):
            seq_input = inputs[i]
            try:
                seq.grammar.fill_bitmask(bitmask, row)
                may_end = seq_input.output_index < seq.sampling_params.min_tokens and seq.grammar.is_completed()
            except Exception as e:
                logger.exception("%s: its grammar failed to give the tokens allowed next", seq.request_id)
                faults[i] = RequestFault.of("structured output's grammar", e)
                continue
            seq_input.token_bitmask = bitmask[row]
            if may_end:
                # A complete output may end: min_tokens must not ban the only tokens the grammar allows.
                seq_input.sampling_params = dataclasses.replace(seq.sampling_params, min_tokens=0)
        return faults

    def _append_token(
        self, seq: Sequence, token: int, after_prefill: bool, logprobs: TokenLogprobs | None = None
    ) -> RequestDelta:
        seq.append_token(token)
        seq.num_computed_tokens = seq.num_tokens - 1
        text = self.detokenizer.step(seq)
        params = seq.sampling_params
        reason = None
        if seq.num_output_tokens < params.min_tokens:
            pass  # nothing but the length stops it yet (the sampler banned its stop tokens)
        elif (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            reason = "stop"
        elif params.stop and find_stop_string(seq, text) is not None:
            reason = "stop"
        if seq.grammar is not None and reason is None:
            if not seq.grammar.accept(token):  # only when the step's bans left no token it allows
                logger.warning("%s: token %d breaks its structured output; it ends here", seq.request_id, token)
                reason = "stop"
            elif seq.grammar.is_terminated():  # complete: nothing may follow, whatever ignore_eos says
                reason = "stop"
        if reason is None and (seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len):
            reason = "length"
        extras = self._logprob_fields(seq, logprobs)
        if reason is not None:
            self._finish(seq, reason)
            return self._delta(seq, [token], self._unsent_text(seq), **extras)
        text = self._unsent_text(seq)  # first: the hand-over says how much text was sent
        handover = self.hand_off(seq) if after_prefill and self.role.after_prefill(seq) else None
        return self._delta(seq, [token], text, handover, first=after_prefill, **extras)

    @staticmethod
    def _logprob_fields(seq: Sequence, logprobs: TokenLogprobs | None) -> dict:
        """The logprobs a token's delta carries: its own, and with the first token the prompt's."""
        params = seq.sampling_params
        fields = {}
        if params.logprobs is not None and logprobs is not None:
            fields["logprobs"] = [logprobs]
        if params.prompt_logprobs is not None and seq.num_output_tokens == 1:
            fields["prompt_logprobs"] = [None, *seq.prompt_logprobs]
        return fields

    @staticmethod
    def _unsent_text(seq: Sequence) -> str:
        """Output text no delta has carried yet; while the request runs, less what may begin a stop
        string (sent text cannot be taken back when the stop string completes)."""
        end = len(seq.output_text) - (0 if seq.is_finished else seq.sampling_params.stop_text_holdback)
        if end <= seq.num_text_sent:
            return ""
        text, seq.num_text_sent = seq.output_text[seq.num_text_sent : end], end
        return text

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if self.kv_hold.drop(seq):
            self.block_manager.free(seq)
        else:
            self.scheduler.finish(seq)
        self.forget(seq)

    def _delta(
        self,
        seq: Sequence,
        tokens: list[int],
        text: str,
        handover: Handover | None = None,
        first: bool = False,
        logprobs: list[TokenLogprobs] | None = None,
        prompt_logprobs: list[TokenLogprobs | None] | None = None,
    ) -> RequestDelta:
        finished = seq.is_finished
        return RequestDelta(
            seq.request_id,
            seq.attempt,
            tokens,
            text,
            finished,
            seq.finish_reason,
            seq.num_cached_tokens,
            handover,
            tuple(getattr(seq.metrics, name) for name in STAGE_FIELDS),
            seq.metrics.steps if finished else None,
            seq.num_preemptions,
            first,
            logprobs,
            prompt_logprobs,
            seq.sample_index if seq.beams is None else 0,  # a beam's end is no output of its own
            len(self.requests.get(seq.request_id, ())) if finished else 0,  # it is forgotten by then
        )
