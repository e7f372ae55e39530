"""Steady stretches of decode steps, passed at once with the result of stepping through them.

A stretch is the decode steps an instance runs while nothing else happens to it: no request
arrives, is handed over or pulled, none finishes, no prompt waits, and every sequence's next block
is free, so none is preempted. Its steps are then the one before them again, each sequence a token
longer, and what stepping would do is known in advance: the step times (``step_time`` with the
context grown by the batch size a step, or ``StepTimes`` for all of them at once), and the blocks
``RunningBatch.grow`` takes, which the ``BlockManager`` is given here in the same order.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from itertools import accumulate

from distserve.scheduling.block_manager import BlockManager
from placement.sim_sequence import SimSequence
from placement.sim_specs import StepTimes

FIRST_LOOK = 16  # steps whose times are worked out first; then four times as many at each look


def step_ends(
    step_time: Callable[[int, int], float],
    step_times: StepTimes | None,
    batch_size: int,
    context: int,
    first_end: float,
    max_steps: int,
    until: float,
) -> list[float]:
    """The end times of the stretch's steps: the first ends at ``first_end`` with ``context`` tokens in
    its batch, each next starts at the end of the one before. Steps are added while the last ends
    before ``until`` (the next event that reaches the instance), at most ``max_steps`` in all."""
    ends = [first_end]
    end = first_end
    look = FIRST_LOOK
    while len(ends) < max_steps and end < until:
        count = min(look, max_steps - len(ends))
        first_context = context + batch_size * len(ends)
        if step_times is None:
            times = [step_time(batch_size, first_context + batch_size * i) for i in range(count)]
        else:
            times = step_times(batch_size, first_context, count).tolist()
        new = list(accumulate(times, initial=end))[1:]  # added in turn, as stepping adds them
        cut = bisect_left(new, until)  # the first to end at or after ``until`` is the last
        ends += new[: cut + 1]
        end = ends[-1]
        look *= 4
    return ends


def steps_with_free_blocks(seqs: list[SimSequence], block_size: int, free_blocks: int, max_steps: int) -> int:
    """How many steps, the first already given its blocks, ``seqs`` run before one needs a block
    when none is free (at most ``max_steps``). A sequence of ``n`` tokens at the first step takes a
    block at step ``j`` when its newest token then, the ``n + j - 1``-th, starts one."""
    needing = [0] * block_size  # sequences by the step (mod block size) at which they take a block
    for seq in seqs:
        needing[(2 - seq.num_tokens) % block_size] += 1
    steps = 1
    while steps < max_steps:
        free_blocks -= needing[(steps + 1) % block_size]
        if free_blocks < 0:
            break
        steps += 1
    return steps


def grow_blocks(manager: BlockManager, seqs: list[SimSequence], steps: int) -> None:
    """``RunningBatch.grow``'s block work for steps 2 to ``steps`` of the stretch, ``seqs`` in batch
    order: ``append_slot`` at each step for each sequence whose newest token then starts a block
    (which takes one: these in batch order, as the blocks each gets depend on it) or fills one (which
    enters the prefix cache); at other steps it does nothing. Each sequence's count is its token
    count at that step for the call, then back at the first step's."""
    by_residue: dict[int, list[SimSequence]] = {}
    for seq in seqs:
        by_residue.setdefault(seq.num_tokens % manager.block_size, []).append(seq)
    size = manager.block_size
    # Residues of the token count at the first step of the sequences whose step-j token starts a
    # block, and of those whose step-j token fills one (the same sequences when blocks are single tokens).
    for step in range(1, steps):
        residues = [(1 - step) % size]
        if manager.enable_prefix_caching and size > 1:
            residues.append(-step % size)
        for residue in residues:
            for seq in by_residue.get(residue, ()):
                first = seq.num_tokens
                seq.num_tokens = first + step
                manager.append_slot(seq)
                seq.num_tokens = first
