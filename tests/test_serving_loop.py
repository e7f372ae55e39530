"""The serving loop's helpers on their own: the input workers, which take requests' CPU work off it,
and its lag, which liveness deadlines leave out (in a running cluster:
tests/test_faults.py::test_a_held_serving_loop_fences_no_instance)."""

import asyncio
import threading
import time

import pytest

from distserve.cluster.input_workers import InputWorkers
from distserve.cluster.loop_lag import LoopLag


def test_input_workers_run_jobs_off_the_loop_in_order():
    async def scenario():
        workers = InputWorkers(num_workers=1)
        release = threading.Event()
        ran: list[str] = []

        def job(name: str) -> int:
            release.wait(10)
            ran.append(name)
            return threading.get_ident()

        jobs = {name: asyncio.ensure_future(workers.run(job, name)) for name in ("first", "dropped", "second")}
        await asyncio.sleep(0.05)
        assert not any(j.done() for j in jobs.values())  # the first runs, the others wait
        dropped = jobs.pop("dropped")
        dropped.cancel()  # a job cancelled while it waits never runs
        await asyncio.wait([dropped])  # the cancellation reaches the job's task
        release.set()
        threads = await asyncio.gather(*jobs.values())
        assert ran == ["first", "second"]
        assert threading.get_ident() not in threads  # the loop's thread ran neither
        with pytest.raises(ZeroDivisionError):  # a job's exception reaches its caller
            await workers.run(lambda: 1 / 0)
        workers.shutdown()

    asyncio.run(scenario())


def test_a_stopwatch_leaves_out_the_time_the_loop_was_held():
    async def scenario():
        lag = LoopLag()
        task = asyncio.create_task(lag.run())
        await asyncio.sleep(0.2)
        running = lag.stopwatch()
        time.sleep(1.0)  # the loop held: its tick is a second late
        assert running() < 0.2  # at once, before the late tick has run
        await asyncio.sleep(0.3)
        assert 0.25 < running() < 0.6 and lag.largest > 0.9
        task.cancel()

    asyncio.run(scenario())
