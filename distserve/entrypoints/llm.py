"""Offline API: one colocated engine in this process, no Ray.

from distserve import LLM, SamplingParams
outputs = LLM("tiny-llama").generate(["Hello"], SamplingParams(max_tokens=8))
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from distserve.core.config import EngineConfig
from distserve.core.outputs import OutputBuilder, RequestOutput
from distserve.core.role import Role
from distserve.core.sampling_params import SamplingParams
from distserve.engine.llm_engine import LLMEngine


class LLM:
    def __init__(self, model: str = "tiny-llama", config: EngineConfig | None = None, **options: Any) -> None:
        """``options`` are flat engine options (``block_size=8``, ``policy="sjf"`` ...), see docs/configuration.md."""
        if config is None:
            config = EngineConfig.from_flat(model=model, **options)
        elif options:
            raise ValueError("pass either config or keyword options, not both")
        if config.scheduler.role is not Role.COLOCATED:
            raise ValueError(
                f"an offline LLM runs both phases in one engine: role '{config.scheduler.role}' "
                "needs a disaggregated cluster"
            )
        self.engine = LLMEngine(config)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """Stop the engine's worker actors (an engine of one rank has none)."""
        self.engine.shutdown()

    def generate(
        self,
        prompts: str | list[int] | Seq[str | list[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts (text, or token id lists) to completion; outputs come back in prompt order.

        Every request is validated before any is queued, so a bad one fails the call cleanly.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(sampling_params)} sampling params")
        seqs = [self.engine.make_sequence(p, sp) for p, sp in zip(prompts, sampling_params)]
        builders = {seq.request_id: OutputBuilder(seq.request_id, seq.prompt, seq.prompt_token_ids) for seq in seqs}
        results: dict[str, RequestOutput] = {}
        try:
            for seq in seqs:
                self.engine.add_sequence(seq)
            while len(results) < len(seqs):
                for delta in self.engine.step():
                    output = builders[delta.request_id].add(delta)
                    if output.finished:
                        results[output.request_id] = output
        finally:
            for seq in seqs:
                if seq.request_id not in results:
                    self.engine.abort_request(seq.request_id)
        return [results[seq.request_id] for seq in seqs]
