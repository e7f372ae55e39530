"""The engine core of one instance: validate and queue requests, then step the scheduler, the
model runner, the sampler and the output processing, one batch at a time."""

from __future__ import annotations

import dataclasses
import logging
import time

from transformers import GenerationConfig

from distserve.core.config import EngineConfig
from distserve.core.outputs import RequestOutput
from distserve.core.sampling_params import SamplingParams
from distserve.core.sequence import Sequence, SequenceStatus
from distserve.core.step_metrics import StepRecord, StepStats, StepTimer
from distserve.engine.detokenizer import Detokenizer, find_stop_string
from distserve.engine.executor import make_executor
from distserve.engine.input_processor import InputProcessor
from distserve.kv_transfer.migrator import PrefilledRequest
from distserve.model_executor.model_loader import ResolvedModel, load_tokenizer, resolve_model
from distserve.model_executor.model_runner import BatchInput
from distserve.parallel.ranks import check_parallel_config
from distserve.scheduling.block_manager import BlockManager
from distserve.scheduling.prefill_only_scheduler import PrefillOnlyScheduler
from distserve.scheduling.scheduler import PrefillFirstScheduler

logger = logging.getLogger(__name__)


class LLMEngine:
    """Scheduler, block manager and output processing of one instance; the model runs in its executor."""

    def __init__(self, config: EngineConfig, max_step_records: int = 0, name: str = "engine") -> None:
        self.config = config
        self.name = name
        self.role = config.scheduler.scheduler
        resolved = resolve_model(config.model)
        check_parallel_config(resolved.hf_config, config.parallel)
        self.tokenizer = load_tokenizer(resolved)
        self.max_model_len = resolved.max_model_len
        self.vocab_size = resolved.hf_config.vocab_size
        self.eos_token_ids = self._eos_token_ids(resolved)
        max_tokens = config.scheduler.max_num_seqs * self.max_model_len
        self.executor = make_executor(config, max_tokens, name)
        num_blocks = self.executor.num_blocks
        # A decode instance fills blocks by pulls that finish after allocation: sharing them through
        # the prefix cache could hand out blocks whose KV has not arrived yet.
        prefix_caching = config.cache.enable_prefix_caching and self.role != "decode"
        self.block_manager = BlockManager(num_blocks, config.cache.block_size, prefix_caching)
        self.scheduler: PrefillFirstScheduler | PrefillOnlyScheduler
        if self.role == "prefill":
            self.scheduler = PrefillOnlyScheduler(config.scheduler, self.block_manager)
        else:  # a decode instance recomputes preempted requests itself, through the same prefill queue
            self.scheduler = PrefillFirstScheduler(config.scheduler, self.block_manager)
        self.detokenizer = Detokenizer(self.tokenizer)
        self.input_processor = InputProcessor(
            self.tokenizer, self.vocab_size, self.max_model_len, num_blocks, config.cache.block_size
        )
        self.requests: dict[str, Sequence] = {}
        self.admitting: dict[str, Sequence] = {}  # decode: blocks allocated, KV being pulled
        self.stats = StepStats(max_step_records)

    def _eos_token_ids(self, resolved: ResolvedModel) -> frozenset[int]:
        try:
            generation_config = GenerationConfig.from_pretrained(resolved.model_dir)
        except (OSError, TypeError):  # no generation_config.json (or no directory: a preset)
            generation_config = GenerationConfig.from_model_config(resolved.hf_config)
        ids = set()
        for value in (generation_config.eos_token_id, self.tokenizer.eos_token_id):
            if isinstance(value, int):
                ids.add(value)
            elif value:
                ids.update(value)
        return frozenset(ids)

    def shutdown(self) -> None:
        self.executor.shutdown()

    # Requests -----------------------------------------------------------------------------

    def make_sequence(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
    ) -> Sequence:
        """Validate a request and build its sequence; raises ValueError saying what to fix."""
        return self.input_processor.process(prompt, params, request_id, priority)

    def add_sequence(self, seq: Sequence) -> None:
        if seq.request_id in self.requests:
            raise ValueError(f"request id '{seq.request_id}' is already in use")
        self.detokenizer.start(seq)
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)

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

    def abort_request(self, request_id: str, reason: str = "abort") -> RequestOutput | None:
        """Stop a request wherever it is and free its blocks; None if it is not running here.

        ``reason`` is "abort" when a client cancels, "error" when the request cannot go on here.
        """
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        self._finish(seq, reason)
        return self._output(seq, 0, "")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # Disaggregation ---------------------------------------------------------------------------

    def release_prefilled(self, request_id: str) -> bool:
        """Prefill: a decode instance has pulled the request's KV; free its blocks."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        seq.status = SequenceStatus.FINISHED
        self.scheduler.finish(seq)
        return True

    def admit_prefilled(self, prefilled: PrefilledRequest) -> Sequence | None:
        """Decode: allocate blocks for a prefilled request, or None while there is no room.

        The request decodes only after ``start_decoding``, once its KV has been pulled into them.
        """
        if prefilled.request_id in self.requests:
            raise ValueError(f"request id '{prefilled.request_id}' is already in use")
        if len(self.scheduler.decode) + len(self.admitting) >= self.config.scheduler.max_num_seqs:
            return None
        prompt_ids = prefilled.token_ids[: prefilled.num_prompt_tokens]
        seq = Sequence(
            prompt_ids, prefilled.sampling_params, prefilled.request_id, prefilled.prompt, prefilled.priority
        )
        self.detokenizer.start(seq)
        for token in prefilled.token_ids[prefilled.num_prompt_tokens :]:
            seq.append_token(token)
            self.detokenizer.step(seq)  # the prefill instance already sent this text
        if not self.block_manager.can_allocate(seq):
            return None
        self.block_manager.allocate(seq)
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.requests[seq.request_id] = seq
        self.admitting[seq.request_id] = seq
        return seq

    def start_decoding(self, request_id: str, migration_start: float, migration_end: float) -> None:
        """Decode: the request's KV has arrived; it joins the running batch."""
        seq = self.admitting.pop(request_id)
        seq.metrics.migration_start, seq.metrics.migration_end = migration_start, migration_end
        self.scheduler.decode.add(seq)

    # Stepping -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch; returns an output for every sequence that advanced."""
        timer = StepTimer()
        batch = self.scheduler.schedule()
        timer.lap("schedule")
        if not batch.seqs:
            return []
        model_input = BatchInput.from_sequences(batch.is_prefill, batch.seqs)
        started = time.time()
        output = self.executor.execute_model(model_input)
        timer.lap("execute")
        if batch.is_prefill:
            ended = time.time()
            for seq in batch.seqs:
                if seq.metrics.prefill_end is None:  # the first prefill, not a recompute
                    seq.metrics.prefill_start, seq.metrics.prefill_end = started, ended
        # Split the executor's time into the driver rank's phases and the rest (calls, transfers).
        timer.seconds["dispatch"] = timer.seconds.pop("execute") - sum(output.seconds.values())
        timer.seconds.update(output.seconds)
        tokens = output.sampled_token_ids
        outputs = [self._append_token(seq, token) for seq, token in zip(batch.seqs, tokens)]
        timer.lap("postprocess")
        self.stats.add(StepRecord(batch.is_prefill, len(batch.seqs), model_input.num_tokens, timer.seconds))
        return outputs

    def _append_token(self, seq: Sequence, token: int) -> RequestOutput:
        seq.append_token(token)
        seq.num_computed_tokens = seq.num_tokens - 1
        delta = self.detokenizer.step(seq)
        params = seq.sampling_params
        reason = None
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            reason = "stop"
        elif params.stop:
            text_before = len(seq.output_text) - len(delta)
            if find_stop_string(seq, delta) is not None:
                reason, delta = "stop", seq.output_text[text_before:]
        if reason is None and (seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            self._finish(seq, reason)
        output = self._output(seq, 1, delta)
        if reason is None and self.role == "prefill":
            output.prefilled = PrefilledRequest(
                seq.request_id,
                self.name,
                seq.prompt,
                list(seq.all_token_ids),
                seq.num_prompt_tokens,
                params,
                seq.priority,
                list(seq.block_table),
                self.config.cache.block_size,
            )
        return output

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.scheduler.finish(seq)
        self.admitting.pop(seq.request_id, None)
        del self.requests[seq.request_id]

    def _output(self, seq: Sequence, num_new: int, delta: str) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=seq.output_token_ids,
            text=seq.output_text,
            new_token_ids=seq.all_token_ids[len(seq.all_token_ids) - num_new :] if num_new else [],
            new_text=delta,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            num_cached_tokens=seq.num_cached_tokens,
            metrics=dataclasses.replace(seq.metrics),
        )
