"""Outputs as the serving loop streams them: each delta costs its own size, however long the output
has grown, and the whole-so-far fields read later are those of their output, not the request's now."""

from __future__ import annotations

import dataclasses
import statistics
import tracemalloc

from distserve.cluster.request_table import SampleStream
from distserve.core.outputs import OutputBuilder, RequestDelta, TokenLogprobs
from distserve.core.sampling_params import SamplingParams
from distserve.entrypoints.grpc_server import response_from_output
from distserve.entrypoints.openai_protocol import Call, Job
from distserve.entrypoints.openai_server import _choice_usage, _Formatter, _sse


def _delta(*tokens: int, finished: bool = False, attempt: int = 0) -> RequestDelta:
    logprobs = [TokenLogprobs(i, -0.5, 1, [i], [-0.5]) for i in tokens]
    text = "".join(f"t{i} " for i in tokens)
    reason = "length" if finished else None
    return RequestDelta("r", attempt, list(tokens), text, finished, reason, 0, logprobs=logprobs)


def _per_delta_bytes(length: int, window: int = 64) -> float:
    """The median of the bytes allocated at once (tracemalloc's peak) while one delta goes the serving
    loop's way, an output ``length`` tokens long: the builder adds it (its token times stamped as
    the orchestrator does), the client's stream takes what it lacks, and its SSE chunk (with
    continuous usage and logprobs' token ids) and gRPC message are built."""
    builder = OutputBuilder("r", None, list(range(32)))
    stream = SampleStream(builder)
    formatter = _Formatter(Call(chat=False, jobs=[Job([1, 2], SamplingParams())], return_token_ids=True), None)
    for i in range(length):
        builder.metrics.token_times.append(float(i))
        stream.unseen(builder.add(_delta(i)))
    sizes = []
    tracemalloc.start()
    try:
        for i in range(length, length + window):
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            builder.metrics.token_times.append(float(i))
            output = stream.unseen(builder.add(_delta(i)))
            _sse({"choices": [formatter.chunk_choice(0, output)], "usage": _choice_usage(output, True)})
            response_from_output(output).SerializeToString()
            sizes.append(tracemalloc.get_traced_memory()[1] - before)
            del output
    finally:
        tracemalloc.stop()
    return statistics.median(sizes)


def test_a_delta_costs_its_own_size_however_long_the_output():
    short, long = _per_delta_bytes(16), _per_delta_bytes(20_000)
    # One copy of 20,000 tokens' ids is 160 KiB, of their token times as much again: a delta that
    # copied the output so far would allocate that; one that costs its own size, as at 16 tokens.
    assert long < short + 2048, (short, long)


def test_streamed_outputs_keep_their_own_whole_fields():
    """The whole-so-far fields of an output read after later deltas are still its own."""
    builder = OutputBuilder("r", "prompt", [7, 8])
    outputs = []
    for i in range(6):
        builder.metrics.token_times.append(float(i))
        outputs.append(builder.add(_delta(i, finished=i == 5)))
    for i, output in enumerate(outputs):
        assert output.num_output_tokens == i + 1 == len(output.output_token_ids)
        assert output.output_token_ids == list(range(i + 1))
        assert output.text == "".join(f"t{j} " for j in range(i + 1))
        assert [entry.token_id for entry in output.logprobs] == list(range(i + 1))
        assert output.metrics.token_times == [float(j) for j in range(i + 1)]
        assert (output.new_token_ids, output.new_text) == ([i], f"t{i} ")
    assert outputs[-1].finished and outputs[-1].finish_reason == "length"
    copy = dataclasses.replace(outputs[2], new_text="")  # a copy has every field, read from its own
    assert (copy.output_token_ids, copy.text, copy.num_output_tokens, copy.new_text) == ([0, 1, 2], "t0 t1 t2 ", 3, "")


def test_a_rerun_streams_only_what_the_client_lacks():
    """A re-run repeats the tokens the client has from the failed run: it gets only the ones past them,
    also from a delta that holds some of each."""
    stream = SampleStream(OutputBuilder("r", None, [1]))
    for i in range(3):
        stream.unseen(stream.run.add(_delta(i)))
    stream.run = OutputBuilder("r", None, [1])  # the next attempt starts again from the prompt
    deltas = [_delta(0, 1, attempt=1), _delta(2, 3, attempt=1), _delta(4, finished=True, attempt=1)]
    got = [stream.unseen(stream.run.add(delta)) for delta in deltas]
    assert got[0] is None
    assert [(o.new_token_ids, o.new_text, [e.token_id for e in o.new_logprobs]) for o in got[1:]] == [
        ([3], "t3 ", [3]), ([4], "t4 ", [4]),
    ]  # fmt: skip
    assert got[-1].finished and got[-1].text == "t0 t1 t2 t3 t4 "
