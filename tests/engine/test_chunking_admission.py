"""A chunked request in admission: the real Admission and run_windowed, with futures the test answers
itself (one at a time, after the request has started what it can), so that what is in flight is the
permit's doing, never a speed; and `Admission.resize` under random loads (Hypothesis).
"""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from embed_service.engine.admission import Admission
from embed_service.engine.chunking import Window, run_windowed


def test_windows_count_against_admission_one_slot_each():
    """A chunked request holds one capacity slot per window in flight, never more than it was granted."""

    async def scenario() -> tuple[int, int, int]:
        admission = Admission(capacity=4, reserved=0, interactive_max_inputs=0)
        permit = admission.admit(2)
        in_flight, peak, started = [], 0, 0

        async def plan(first: int, k: int) -> list[list[Window]]:
            return [[Window([1], 0, 1, 1)] * 5 for _ in range(k)]  # 5 windows each

        def submit(windows: list[Window]) -> list[asyncio.Future]:
            nonlocal peak, started
            futures = [asyncio.get_running_loop().create_future() for _ in windows]
            in_flight.extend(futures)
            started += len(futures)
            peak = max(peak, sum(not f.done() for f in in_flight))
            assert admission.in_use <= admission.capacity
            assert sum(not f.done() for f in in_flight) <= admission.in_use
            return futures

        async def answer() -> None:
            while started < 10 or any(not f.done() for f in in_flight):
                await asyncio.sleep(0)
                for f in in_flight:
                    if not f.done():
                        f.set_result(1)
                        break

        task = asyncio.ensure_future(answer())
        results = await run_windowed(permit, 2, plan, submit)
        await task
        permit.close()
        assert [len(r) for r in results] == [5, 5]
        return peak, started, admission.in_use

    peak, started, in_use = asyncio.run(scenario())
    # Planned whole, the request is re-admitted for its 10 windows: the shared part's 4 slots.
    assert started == 10 and peak == 4 and in_use == 0


def test_a_request_of_few_long_inputs_runs_its_windows_side_by_side():
    """One input of 64 windows on the default capacities: its input took one slot of the reserve, and once
    planned the request is re-admitted for its 64 windows, more than an interactive request may have
    (--interactive-max-inputs 32), so as a bulk request of 64 inputs: 64 slots of the shared part, every
    window in flight at once (was: the one slot of its input, one window at a time). One input of 20
    windows fits the reserve: 20 slots there, and it stays interactive. The futures are answered by the
    test, one at a time, after the request has started what it can: the peak is the permit's, not a
    speed."""

    async def scenario(windows: int) -> tuple[int, bool, int]:
        admission = Admission(capacity=2048, reserved=256, interactive_max_inputs=32)
        permit = admission.admit(1)
        assert permit.interactive and permit.held == 1
        in_flight: list[asyncio.Future] = []
        peak = 0
        submitted = asyncio.Event()

        async def plan(first: int, k: int) -> list[list[Window]]:
            return [[Window([1], 0, 1, 1)] * windows for _ in range(k)]

        def submit(ws: list[Window]) -> list[asyncio.Future]:
            nonlocal peak
            futures = [asyncio.get_running_loop().create_future() for _ in ws]
            in_flight.extend(futures)
            peak = max(peak, sum(not f.done() for f in in_flight))
            assert sum(not f.done() for f in in_flight) <= permit.held <= admission.in_use
            submitted.set()
            return futures

        task = asyncio.ensure_future(run_windowed(permit, 1, plan, submit))
        await submitted.wait()  # the request started what its permit allows, in one call
        while not task.done():
            pending = [f for f in in_flight if not f.done()]
            if pending:
                pending[0].set_result(1)
            await asyncio.sleep(0)  # the request's loop runs until it waits on its own windows
        (results,) = await task
        interactive = permit.interactive
        permit.close()
        assert len(results) == windows and admission.in_use == 0
        return peak, interactive, admission.max_window

    peak, interactive, max_window = asyncio.run(scenario(64))
    assert peak == min(64, max_window) == 64 and not interactive
    peak, interactive, _ = asyncio.run(scenario(20))
    assert peak == 20 and interactive


@settings(max_examples=300, deadline=None)
@given(
    capacity=st.integers(4, 300),
    reserved=st.integers(0, 80),
    interactive_max=st.integers(0, 40),
    others=st.lists(st.integers(1, 120), max_size=6),
    inputs=st.integers(1, 40),
    windows=st.integers(0, 200),
)
def test_resize_keeps_the_counts_and_admits_as_a_request_of_that_many_inputs(
    capacity, reserved, interactive_max, others, inputs, windows
):
    """After other requests took what they could, a request of `inputs` inputs is re-admitted for
    `inputs + windows` windows: the counts stay the sum of what the open permits hold, within each part,
    changed once (never through a value nobody holds); the permit holds at least what it held, is
    interactive only with few enough units for the reserve, and takes the shared part's free slots (up to
    the piecewise window) where it moves there."""
    changes: list[int] = []
    admission = Admission(capacity, reserved, interactive_max, on_change=changes.append)
    permits = []
    for n in others:
        try:
            permits.append(admission.admit(n))
        except Exception:
            pass
    try:
        permit = admission.admit(inputs)
    except Exception:
        return  # a 429 before any tokenizing: nothing to resize
    held, units = permit.held, inputs + windows
    free_shared = admission.shared - admission.in_shared + (0 if permit.interactive else held)
    changes.clear()
    admission.resize(permit, units)
    assert len(changes) <= 1 and all(c == admission.in_use for c in changes)
    everyone = [*permits, permit]
    assert admission.in_reserve == sum(p.held for p in everyone if p.interactive) <= admission.reserved
    assert admission.in_shared == sum(p.held for p in everyone if not p.interactive) <= admission.shared
    assert permit.held >= held and permit.unstarted == units
    if permit.interactive:
        assert permit.held == units <= interactive_max or not changes
    elif changes:
        assert permit.held == min(units, free_shared, admission.max_window)
    for p in everyone:
        p.close()
    assert admission.in_use == 0
