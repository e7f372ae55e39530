"""Turns a scheduled batch into model inputs, runs the transformers model over the paged KV
cache, and returns the logits of each sequence's last position."""

from __future__ import annotations

import torch

from distserve.attention import AttentionMetadata, ForwardContext, GatherBuffers, PrefillSeqMeta, forward_context
from distserve.kv_cache import KVCache
from distserve.sequence import Sequence


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, block_size: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = kv_cache.tensor.device
        self.buffers = GatherBuffers()

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def prepare_prefill(
        self, seqs: list[Sequence]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Pack the uncomputed tokens of each sequence; returns ids, positions, metadata, logit rows."""
        bs = self.block_size
        input_ids: list[int] = []
        slot_chunks: list[torch.Tensor] = []
        position_chunks: list[torch.Tensor] = []
        metas: list[PrefillSeqMeta] = []
        last_rows: list[int] = []
        query_start = 0
        for seq in seqs:
            start, end = seq.num_computed_tokens, seq.num_tokens
            input_ids.extend(seq.token_ids[start:])
            blocks = self._tensor(seq.block_table)
            positions = torch.arange(end, device=self.device)
            slots = blocks[positions // bs] * bs + positions % bs
            slot_chunks.append(slots[start:])
            position_chunks.append(positions[start:])
            metas.append(PrefillSeqMeta(query_start, end - start, end, blocks if start > 0 else None))
            query_start += end - start
            last_rows.append(query_start - 1)
        meta = AttentionMetadata(
            is_prefill=True, block_size=bs, slot_mapping=torch.cat(slot_chunks), prefill_seqs=metas
        )
        return self._tensor(input_ids), torch.cat(position_chunks), meta, self._tensor(last_rows)

    def prepare_decode(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, None]:
        """One new token per sequence; context K/V are gathered through padded block tables."""
        bs = self.block_size
        positions = [seq.num_tokens - 1 for seq in seqs]
        slots = [seq.block_table[p // bs] * bs + p % bs for seq, p in zip(seqs, positions)]
        width = max(len(seq.block_table) for seq in seqs)
        tables = self._tensor([seq.block_table + [0] * (width - len(seq.block_table)) for seq in seqs])
        positions_t = self._tensor(positions)
        grid = torch.arange(width * bs, device=self.device)
        mask = (grid[None, :] <= positions_t[:, None])[:, None, None, :]
        meta = AttentionMetadata(
            is_prefill=False,
            block_size=bs,
            slot_mapping=self._tensor(slots),
            decode_block_tables=tables,
            decode_mask=mask,
            decode_positions=positions_t,
        )
        return self._tensor([seq.last_token_id for seq in seqs]), positions_t, meta, None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        logit_rows: torch.Tensor | None,
    ) -> torch.Tensor:
        """Logits ``[batch, vocab]`` of the rows in ``logit_rows`` (all rows when None)."""
        with forward_context(ForwardContext(meta, self.kv_cache.layers, self.buffers)):
            out = self.model(
                input_ids=input_ids[None],
                position_ids=positions[None],
                use_cache=False,
                logits_to_keep=0 if logit_rows is None else logit_rows,
            )
        return out.logits[0]
