"""Offline API: one colocated engine in this process, no Ray.

from distserve import LLM, SamplingParams
outputs = LLM("tiny-llama").generate(["Hello"], SamplingParams(max_tokens=8))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq
from typing import Any

from distserve.core.beams import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from distserve.core.config import EngineConfig
from distserve.core.errors import RequestError
from distserve.core.outputs import OutputBuilder, RequestOutput
from distserve.core.role import Role
from distserve.core.sampling_params import SamplingParams
from distserve.engine.llm_engine import LLMEngine

Prompt = str | list[int] | dict[str, Any]


def prompt_of(prompt: Prompt) -> str | list[int]:
    """The text or token ids of a prompt in any of the forms ``generate`` takes."""
    if not isinstance(prompt, dict):
        return prompt
    keys = set(prompt)
    if keys == {"prompt"} and isinstance(prompt["prompt"], str):
        return prompt["prompt"]
    if keys == {"prompt_token_ids"} and isinstance(prompt["prompt_token_ids"], list):
        return prompt["prompt_token_ids"]
    raise RequestError(
        "a prompt dict must be {'prompt': text} or {'prompt_token_ids': [ids]} (vLLM's TextPrompt and "
        f"TokensPrompt), got the keys {sorted(keys)}"
    )


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

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling params ``generate`` uses when given none: the model's generation config's
        defaults (``generation_config: auto``) over SamplingParams' own, as vLLM's method of the
        name; change a field of them with ``dataclasses.replace``."""
        return self.engine.input_processor.default_params()

    def shutdown(self) -> None:
        """Stop the engine's worker actors (an engine of one rank has none)."""
        self.engine.shutdown()

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in prompt order, and for a request of
        ``n`` samples its n outputs (``RequestOutput.index`` 0 to n-1) in a row. A prompt is text,
        a list of token ids, or vLLM's dict forms: ``{"prompt": text}`` or ``{"prompt_token_ids": ids}``.

        Every request is validated before any is queued, so a bad one fails the call cleanly. A
        request whose step fails (its sampling, its grammar...) ends alone: its outputs have
        ``finish_reason`` "error" and ``error`` saying what failed; the others are as without it.
        Without ``sampling_params``, requests sample with the model's defaults (its
        generation_config.json, under ``generation_config: auto``), as vLLM's ``LLM.generate``;
        SamplingParams given are taken as they are, every field of them.
        """
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = [prompt_of(p) for p in prompts]
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(sampling_params)} sampling params")
        seqs = [self.engine.make_sequence(p, sp) for p, sp in zip(prompts, sampling_params)]
        builders = {
            (seq.request_id, i): OutputBuilder(seq.request_id, seq.prompt, seq.prompt_token_ids, index=i)
            for seq in seqs
            for i in range(seq.num_samples)
        }
        results: dict[tuple[str, int], RequestOutput] = {}
        try:
            for seq in seqs:
                self.engine.add_sequence(seq)
            while len(results) < len(builders):
                for delta in self.engine.step():
                    output = builders[delta.request_id, delta.index].add(delta)
                    if output.finished:
                        results[delta.request_id, delta.index] = output
                    if delta.fault is not None:  # its step failed: every sample of it ends with the error
                        end = dataclasses.replace(delta, new_token_ids=[], new_text="", logprobs=None)
                        for key, builder in builders.items():
                            if key[0] == delta.request_id and key not in results:
                                results[key] = builder.add(end)
        finally:
            for seq in seqs:
                if seq.request_id in self.engine.requests:
                    self.engine.abort_request(seq.request_id)
        return [results[key] for key in builders]

    def beam_search(self, prompts: Prompt | Seq[Prompt], params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search of each prompt, as vLLM's method of the name: its ``beam_width`` results, best
        first. The same as ``generate`` with ``params.sampling_params()``: the beams run in the
        engine, sharing their KV blocks."""
        outputs = self.generate(prompts, params.sampling_params())
        results = []
        for i in range(0, len(outputs), params.beam_width):
            sequences = [
                BeamSearchSequence(
                    [*o.prompt_token_ids, *o.output_token_ids],
                    o.text,
                    o.cumulative_logprob,
                    o.beam_score,
                    o.finish_reason,
                )  # fmt: skip
                for o in outputs[i : i + params.beam_width]
            ]
            results.append(BeamSearchOutput(sequences))
        return results
