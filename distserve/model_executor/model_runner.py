"""Turns a scheduled batch into model inputs, runs this rank's part of the transformers model over
its paged KV cache, and returns the logits of each sequence's last position (on the last pipeline
stage) or the hidden states for the next stage."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from distserve.core.sampling_params import SamplingParams
from distserve.core.sequence import Sequence
from distserve.kv_connector.base import KVConnectorMetadata
from distserve.model_executor.attention import (
    AttentionMetadata,
    DecodePlan,
    ForwardContext,
    GatherBuffers,
    PagedQueries,
    PrefillSeqMeta,
    forward_context,
    padded_block_tables,
)
from distserve.model_executor.kv_cache import KVCache
from distserve.parallel.pipeline_parallel import PipelineStage, StageDone

# What a beam's row is sampled with: greedy, untouched by any logits processor (the engine picks
# its next token among its candidates, not the sampler).
BEAM_ROW_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


@dataclass
class SeqInput:
    """What a worker needs of one sequence for one step: small, so it crosses to workers cheaply."""

    input_token_ids: list[int]  # tokens to run: the uncomputed prompt (prefill) or the newest token (decode)
    start: int  # position of input_token_ids[0]; everything before it is in the KV cache
    block_table: list[int]
    sampling_params: SamplingParams
    output_index: int  # which output token the step samples (seeded sampling draws per position)
    sample: bool = True  # False for a prompt chunk short of the prompt's end: no token comes of it
    # The request's tokens so far, prompt first: only for what needs them (penalties, multi-token
    # bad words, prompt logprobs), so that other requests' inputs stay small.
    token_history: list[int] | None = None
    # Its structured outputs' allowed tokens for this step (a row of int32 words), or None.
    token_bitmask: torch.Tensor | None = None
    # At the prompt's end of a request of n samples: the params of samples 1..n-1, which draw
    # their first tokens from the same logits (``fan_out_samples``).
    sibling_params: list[SamplingParams] | None = None
    # A beam of a beam search: how many of its likeliest next tokens the step returns, with their
    # logprobs (``ModelOutput.beam_candidates``); 0 otherwise.
    beam_candidates: int = 0

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether this step computes logprobs of its prompt tokens: a first prefill that asks."""
        return self.sampling_params.prompt_logprobs is not None and self.output_index == 0

    @property
    def num_logit_rows(self) -> int:
        """Rows of logits the step needs of this sequence: every new token's with prompt logprobs,
        else the last one's if it samples."""
        if self.wants_prompt_logprobs:
            return len(self.input_token_ids)
        return 1 if self.sample else 0

    @classmethod
    def from_sequence(cls, seq: Sequence, is_prefill: bool, num_new_tokens: int | None = None) -> SeqInput:
        """The sequence's uncomputed tokens (prefill) or its newest token (decode); ``num_new_tokens``
        runs only that many, a chunk of its prompt."""
        start = seq.num_computed_tokens if is_prefill else seq.num_tokens - 1
        end = seq.num_tokens if num_new_tokens is None else start + num_new_tokens
        tokens = seq.all_token_ids[start:end]
        params = seq.sampling_params
        needs_history = params.penalized or (is_prefill and params.prompt_logprobs is not None)
        sample = end == seq.num_tokens
        if params.beam_width is not None:  # its token is chosen from the candidates, not sampled
            return cls(tokens, start, list(seq.block_table), BEAM_ROW_PARAMS, seq.num_output_tokens, sample,
                       beam_candidates=params.num_beam_candidates if sample else 0)  # fmt: skip
        forks = sample and params.n > 1 and not seq.num_output_tokens
        return cls(
            tokens,
            start,
            list(seq.block_table),
            params,
            seq.num_output_tokens,
            sample,
            seq.all_token_ids if needs_history else None,
            sibling_params=[params.sample_params(i) for i in range(1, params.n)] if forks else None,
        )


@dataclass
class BatchInput:
    """A step's sequences: all decode (``is_prefill`` False), all prefill, or with chunked prefill
    the first ``num_decode`` decoding one token each and the rest running prompt chunks."""

    is_prefill: bool
    seqs: list[SeqInput]
    num_decode: int = 0
    # Blocks to copy (source, destination) before the forward pass: a sample's first write into a
    # block it shared with its siblings (``BlockManager.append_slot``).
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # What each KV connector with work this step loads before those copies and saves after the
    # forward pass (swap, the prefix tier), in the order of their loads.
    kv_connectors: list[KVConnectorMetadata] = field(default_factory=list)

    @classmethod
    def from_sequences(
        cls, is_prefill: bool, seqs: list[Sequence], num_decode: int = 0, num_new_tokens: list[int] | None = None
    ) -> BatchInput:
        counts = num_new_tokens or [None] * len(seqs)
        inputs = [
            SeqInput.from_sequence(seq, is_prefill and i >= num_decode, count)
            for i, (seq, count) in enumerate(zip(seqs, counts))
        ]
        return cls(is_prefill, inputs, num_decode if is_prefill else len(seqs))

    @property
    def num_tokens(self) -> int:
        return sum(len(s.input_token_ids) for s in self.seqs)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        block_size: int,
        stage: PipelineStage | None = None,
        attention_backend: str = "sdpa",
    ) -> None:
        self.model = model
        self.attention_backend = attention_backend  # resolved: cpp, compiled, triton or sdpa
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.stage = stage
        self.device = kv_cache.tensor.device
        self.buffers = GatherBuffers()

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def prepare(self, batch: BatchInput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor | None]:
        """Input ids, positions, attention metadata and the rows whose logits are needed."""
        if not batch.is_prefill:
            prepared = self.prepare_decode(batch.seqs)
        elif batch.num_decode == 0:
            prepared = self.prepare_prefill(batch.seqs)
        else:
            prepared = self.prepare_mixed(batch.seqs[: batch.num_decode], batch.seqs[batch.num_decode :])
        if self.attention_backend == "cpp":
            prepared[2].paged = self.paged_queries(batch)
        return prepared

    def paged_queries(self, batch: BatchInput) -> PagedQueries:
        """Every query row of the batch by sequence, for the C++ kernel: a decode token, or a
        prompt's new tokens (the last of its context; the earlier ones cached, if any)."""
        seqs, row = [], 0
        for i, seq in enumerate(batch.seqs):
            count = 1 if i < batch.num_decode else len(seq.input_token_ids)
            seqs.append((seq.block_table, row, count, seq.start + count))
            row += count
        return PagedQueries.build(seqs, self.device)

    def prepare_mixed(
        self, decode: list[SeqInput], prompts: list[SeqInput]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Decode tokens first, then prompt chunks, in one packed sequence (chunked prefill)."""
        d_ids, d_positions, d_meta, _ = self.prepare_decode(decode)
        p_ids, p_positions, p_meta, p_rows = self.prepare_prefill(prompts, query_offset=len(decode))
        meta = dataclasses.replace(
            d_meta,
            is_prefill=True,
            slot_mapping=torch.cat([d_meta.slot_mapping, p_meta.slot_mapping]),
            prefill_seqs=p_meta.prefill_seqs,
            num_decode_tokens=len(decode),
        )
        rows = torch.cat([torch.arange(len(decode), device=self.device), p_rows + len(decode)])
        return torch.cat([d_ids, p_ids]), torch.cat([d_positions, p_positions]), meta, rows

    def prepare_prefill(
        self, seqs: list[SeqInput], query_offset: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Pack the new tokens of each sequence (after ``query_offset`` tokens of others); the logit
        rows of each sequence are its last ``num_logit_rows`` tokens'."""
        bs = self.block_size
        input_ids: list[int] = []
        slot_chunks: list[torch.Tensor] = []
        position_chunks: list[torch.Tensor] = []
        metas: list[PrefillSeqMeta] = []
        last_rows: list[int] = []
        query_start = query_offset
        for seq in seqs:
            start, end = seq.start, seq.start + len(seq.input_token_ids)
            input_ids.extend(seq.input_token_ids)
            blocks = self._tensor(seq.block_table)
            positions = torch.arange(end, device=self.device)
            slots = blocks[positions // bs] * bs + positions % bs
            slot_chunks.append(slots[start:])
            position_chunks.append(positions[start:])
            metas.append(PrefillSeqMeta(query_start, end - start, end, blocks if start > 0 else None))
            rows = seq.num_logit_rows
            query_start += end - start
            last_rows.extend(range(query_start - rows - query_offset, query_start - query_offset))
        meta = AttentionMetadata(
            is_prefill=True, block_size=bs, slot_mapping=torch.cat(slot_chunks), prefill_seqs=metas
        )
        return self._tensor(input_ids), torch.cat(position_chunks), meta, self._tensor(last_rows)

    def prepare_decode(self, seqs: list[SeqInput]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, None]:
        """One new token per sequence, attending over its context through its block table: as
        (sequence, block) pairs for the compiled kernel, as padded tables for the Triton kernel,
        as padded tables and a mask for SDPA (the C++ kernel's rows: ``paged_queries``)."""
        bs = self.block_size
        positions = [seq.start for seq in seqs]
        slots = [seq.block_table[p // bs] * bs + p % bs for seq, p in zip(seqs, positions)]
        positions_t = self._tensor(positions)
        meta = AttentionMetadata(
            is_prefill=False, block_size=bs, slot_mapping=self._tensor(slots), decode_positions=positions_t
        )
        if self.attention_backend == "compiled":
            meta.decode_plan = DecodePlan.build([seq.block_table for seq in seqs], positions, bs, self.device)
        elif self.attention_backend == "triton":
            tables = padded_block_tables([seq.block_table for seq in seqs])
            meta.decode_block_tables = torch.tensor(tables, dtype=torch.int32, device=self.device)
        elif self.attention_backend == "sdpa":
            meta.decode_block_tables = self._tensor(padded_block_tables([seq.block_table for seq in seqs]))
            grid = torch.arange(meta.decode_block_tables.shape[1] * bs, device=self.device)
            meta.decode_mask = (grid[None, :] <= positions_t[:, None])[:, None, None, :]
        return self._tensor([seq.input_token_ids[-1] for seq in seqs]), positions_t, meta, None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        logit_rows: torch.Tensor | None,
        received: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[batch, vocab]`` of ``logit_rows`` (all rows when None) on the last stage; on an
        earlier stage the hidden states ``[tokens, hidden]`` its last layer produced. ``received``
        is the previous stage's output."""
        if self.stage is not None:
            self.stage.received = received
        try:
            context = ForwardContext(
                meta, self.kv_cache.layers, self.buffers, self.attention_backend, self.kv_cache.shape.cache_dtype
            )
            with forward_context(context):
                out = self.model(
                    input_ids=input_ids[None],
                    position_ids=positions[None],
                    use_cache=False,
                    logits_to_keep=0 if logit_rows is None else logit_rows,
                )
        except StageDone as done:
            return done.hidden_states
        return out.logits[0]
