"""The batcher with several replicas: work is shared, the priority replica stays small, and a short
request goes into the next batch ahead of queued bulk work. Whatever fails (batch formation, a backend
raising, returning too few results or being lost, stop()), every admitted input is answered exactly once:
with its own result, retried once on another backend, or with an error."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embed_service.batching.batcher import BackendLost, Batcher, ShortResultError
from embed_service.batching.policy import PriorityFirst
from embed_service.batching.sequence import RequestState, Sequence


class Backend:
    """A compute function that records the batches it ran (token counts per sequence)."""

    def __init__(self, seconds: float = 0.0):
        self.batches: list[list[int]] = []
        self.seconds = seconds
        self.lock = threading.Lock()

    def __call__(self, ids, lengths, requests):
        time.sleep(self.seconds)
        with self.lock:
            self.batches.append(lengths.tolist())
        return [n for n in lengths.tolist()]


class Gated(Backend):
    """A Backend whose first batch, once started (`started`), waits for `release`: the batch is running for
    as long as the test needs, on any machine."""

    def __init__(self):
        super().__init__()
        self.started, self.release = threading.Event(), threading.Event()

    def __call__(self, ids, lengths, requests):
        if not self.started.is_set():
            self.started.set()
            assert self.release.wait(60), "never released"
        return super().__call__(ids, lengths, requests)


async def until(event: threading.Event) -> None:
    """Wait for a compute thread's event without blocking the loop."""
    assert await asyncio.get_running_loop().run_in_executor(None, event.wait, 60), "the event never came"


def run(coro):
    return asyncio.run(coro)


def make(loop, lengths):
    state = RequestState()
    return [Sequence([1] * n, loop.create_future(), state) for n in lengths]


async def start_bulk(batcher: Batcher, gates: list[Gated], lengths: list[int]) -> list[Sequence]:
    """Start `batcher`, submit bulk sequences of these lengths, and return once every gate's backend is
    inside its first batch."""
    batcher.start()
    bulk = make(asyncio.get_running_loop(), lengths)
    batcher.submit(bulk)
    for gate in gates:
        await until(gate.started)
    return bulk


def test_idle_replicas_share_the_waiting_work():
    a, b = Backend(0.05), Backend(0.05)

    async def main():
        batcher = Batcher([a, b], 16384, 256, "m")
        batcher.start()
        seqs = make(asyncio.get_running_loop(), [16] * 128)
        batcher.submit(seqs)
        results = await asyncio.gather(*(s.future for s in seqs))
        await batcher.stop()
        return results

    assert run(main()) == [16] * 128
    assert a.batches and b.batches  # both replicas computed part of it


def test_the_priority_replica_takes_small_batches_while_interactive_traffic_is_about():
    a, b = Backend(0.01), Backend(0.01)

    async def main():
        batcher = Batcher([a, b], 16384, 256, "m", priority_batch_tokens=256)
        batcher.start()
        loop = asyncio.get_running_loop()
        short = make(loop, [5])
        batcher.submit(short, priority=True)
        await short[0].future
        seqs = make(loop, [200] * 40)
        batcher.submit(seqs)
        await asyncio.gather(*(s.future for s in seqs))
        await batcher.stop()

    run(main())
    assert all(sum(batch) <= 256 or len(batch) == 1 for batch in b.batches)
    assert max(sum(batch) for batch in a.batches) > 256


def test_a_short_request_under_a_deep_bulk_queue_runs_in_a_batch_of_its_own():
    """Bulk work queued past the aging bound while the other replica computes a bulk batch: the short
    request's batch on the free replica holds the short request only (was: an aged 200-token bulk sequence
    rode in front of it, so the short request paid a bulk forward)."""
    a, b = Gated(), Gated()

    async def main():
        batcher = Batcher([a, b], 16384, 256, "m", priority_batch_tokens=256, bulk_aging_s=0.001)
        bulk = await start_bulk(batcher, [a, b], [200] * 60)
        loop = asyncio.get_running_loop()
        while time.perf_counter() - batcher.queue[0].enqueued_at <= 0.001:  # past the aging bound
            await asyncio.sleep(0)
        short = make(loop, [5])
        batcher.submit(short, priority=True)
        b.release.set()
        await short[0].future
        a.release.set()
        await asyncio.gather(*(s.future for s in bulk))
        await batcher.stop()

    run(main())
    assert b.batches[1] == [5]


def test_without_interactive_traffic_the_reserved_replica_takes_larger_batches():
    a, b = Backend(0.05), Backend(0.05)

    async def main():
        batcher = Batcher([a, b], 16384, 256, "m", priority_batch_tokens=256)
        batcher.start()
        seqs = make(asyncio.get_running_loop(), [200] * 40)
        batcher.submit(seqs)
        await asyncio.gather(*(s.future for s in seqs))
        await batcher.stop()

    run(main())
    assert b.batches and max(sum(batch) for batch in b.batches) > 256


def test_a_short_request_goes_ahead_of_queued_bulk_work():
    a = Gated()

    async def main():
        batcher = Batcher([a], 64, 256, "m")
        batcher.start()
        loop = asyncio.get_running_loop()
        bulk = make(loop, [64] * 10)
        batcher.submit(bulk)
        await until(a.started)  # the first bulk batch is running (and stays so until released)
        short = make(loop, [7])
        batcher.submit(short, priority=True)
        a.release.set()
        await asyncio.gather(*(s.future for s in bulk + short))
        await batcher.stop()

    run(main())
    assert a.batches[1] == [7]  # the very next batch, before nine waiting bulk ones


# --- every admitted input is answered exactly once ---------------------------------------------------


class RaisesOnce(PriorityFirst):
    """A policy with a bug: the first batch it forms takes a sequence out of the lane, then raises."""

    def __init__(self):
        super().__init__()
        self.raised = False

    def take_lanes(self, priority, bulk, *args, **kwargs):
        if not self.raised and bulk:
            self.raised = True
            bulk.popleft()
            raise ValueError("a bug in forming a batch")
        return super().take_lanes(priority, bulk, *args, **kwargs)


def outcomes(futures) -> list:
    return [f.exception() if f.exception() else f.result() for f in futures]


def test_an_error_while_forming_a_batch_answers_its_sequences_and_the_loop_keeps_serving():
    async def main():
        batcher = Batcher([Backend()], 64, 256, "m")
        batcher.policy = RaisesOnce()
        loop = asyncio.get_running_loop()
        seqs = make(loop, [3, 4, 5])
        batcher.submit(seqs)
        batcher.start()
        done, pending = await asyncio.wait([s.future for s in seqs], timeout=5)
        assert not pending, "a sequence taken by the failed batch is never answered"
        later = make(loop, [6])
        batcher.submit(later)
        result = await asyncio.wait_for(later[0].future, 5)
        await batcher.stop()
        return outcomes(s.future for s in seqs), result

    got, later = run(main())
    assert isinstance(got[0], ValueError) and got[1:] == [4, 5]
    assert later == 6


def test_token_ids_outside_int32_fail_their_batch_not_the_loop():
    async def main():
        batcher = Batcher([Backend()], 64, 256, "m")
        batcher.start()
        loop = asyncio.get_running_loop()
        bad = [Sequence([2**40], loop.create_future(), RequestState())]
        batcher.submit(bad)
        with pytest.raises(OverflowError):
            await asyncio.wait_for(bad[0].future, 5)
        good = make(loop, [2])
        batcher.submit(good)
        result = await asyncio.wait_for(good[0].future, 5)
        await batcher.stop()
        return result

    assert run(main()) == 2


def test_a_backend_returning_fewer_results_fails_the_batch_instead_of_leaving_it_pending():
    def short(ids, lengths, requests):
        return lengths.tolist()[:-1]

    async def main():
        batcher = Batcher([short], 64, 256, "m")
        batcher.start()
        seqs = make(asyncio.get_running_loop(), [3, 4])
        batcher.submit(seqs)
        await asyncio.wait([s.future for s in seqs], timeout=5)
        await batcher.stop()
        return [s.future for s in seqs]

    futures = run(main())
    assert all(f.done() for f in futures)
    assert all(isinstance(f.exception(), ShortResultError) for f in futures)
    assert "returned 1 results for a batch of 2" in str(futures[0].exception())


def test_stop_answers_what_is_waiting_and_what_is_running():
    blocked = Gated()

    async def main():
        batcher = Batcher([blocked], 8, 256, "m")
        batcher.start()
        seqs = make(asyncio.get_running_loop(), [8, 8, 8])  # one runs, two wait
        batcher.submit(seqs)
        await until(blocked.started)
        await batcher.stop(ConnectionAbortedError("shutting down"))
        blocked.release.set()
        return [s.future for s in seqs]

    futures = run(main())
    assert [type(f.exception()) for f in futures] == [ConnectionAbortedError] * 3


def test_a_coroutine_backend_is_awaited_on_the_loop_and_a_failure_is_retried_like_any_other():
    threads: set[int] = set()
    failed: list[list[int]] = []
    took: asyncio.Event | None = None

    async def on_loop(ids, lengths, requests):
        threads.add(threading.get_ident())
        # It waits on the loop (as the workers' pipes do), busy until the failing backend took a batch.
        assert took is not None
        await asyncio.wait_for(took.wait(), 60)
        return lengths.tolist()

    async def failing(ids, lengths, requests):
        failed.append(lengths.tolist())
        assert took is not None
        took.set()
        raise RuntimeError("injected")

    async def main():
        nonlocal took
        took = asyncio.Event()
        batcher = Batcher([failing, on_loop], 16, 256, "m")
        batcher.start()
        seqs = make(asyncio.get_running_loop(), [5, 6, 7, 8, 9])
        batcher.submit(seqs)
        results = await asyncio.wait_for(asyncio.gather(*(s.future for s in seqs)), 60)
        await batcher.stop()
        return results, threading.get_ident()

    results, loop_thread = run(main())
    assert results == [5, 6, 7, 8, 9]
    assert threads == {loop_thread}  # no compute thread
    assert failed  # the failing backend took a batch, and its sequences were answered by the other


def test_a_failed_batch_is_retried_once_on_another_backend():
    calls: list[tuple[str, list[int]]] = []
    failed = threading.Event()

    def failing(ids, lengths, requests):
        calls.append(("failing", lengths.tolist()))
        failed.set()
        raise RuntimeError("injected")

    def healthy(ids, lengths, requests):
        # busy until the failing backend has taken a batch (two batches: 26 tokens, 16 a batch)
        assert failed.wait(60), "the failing backend was never given a batch"
        calls.append(("healthy", lengths.tolist()))
        return lengths.tolist()

    async def main():
        batcher = Batcher([failing, healthy], 16, 256, "m")
        batcher.start()
        seqs = make(asyncio.get_running_loop(), [5, 6, 7, 8])
        batcher.submit(seqs)
        results = await asyncio.wait_for(asyncio.gather(*(s.future for s in seqs)), 5)
        await batcher.stop()
        return results

    assert run(main()) == [5, 6, 7, 8]
    assert any(name == "failing" for name, _ in calls)  # it did fail some


def test_a_lost_backend_gets_no_batches_until_it_is_up_and_alone_fails_what_waits():
    lost = {"now": True}

    def backend(ids, lengths, requests):
        if lost["now"]:
            raise BackendLost("replica 0 is gone")
        return lengths.tolist()

    async def main():
        batcher = Batcher([backend], 64, 256, "m")
        batcher.start()
        loop = asyncio.get_running_loop()
        first = make(loop, [3])
        batcher.submit(first)
        await asyncio.wait([first[0].future], timeout=5)
        meanwhile = make(loop, [4])
        batcher.submit(meanwhile)  # no backend is up: answered at once
        assert meanwhile[0].future.done()
        lost["now"] = False
        batcher.backend_up(0)
        after = make(loop, [5])
        batcher.submit(after)
        result = await asyncio.wait_for(after[0].future, 5)
        await batcher.stop()
        return first[0].future.exception(), meanwhile[0].future.exception(), result

    first, meanwhile, after = run(main())
    assert isinstance(first, BackendLost) and isinstance(meanwhile, BackendLost)
    assert after == 5


# --- property: random traffic against fake backends that fail --------------------------------------

ACTIONS = ["ok", "ok", "ok", "slow", "raise", "short", "lost"]


class Fake:
    """A backend that follows a plan, one action per call, and answers each sequence with its own
    (number, length). A "lost" backend raises BackendLost and is brought back a little later."""

    def __init__(self, index: int, plan: list[str], log: list, restart):
        self.index, self.plan, self.log, self.restart = index, plan, log, restart
        self.calls = 0

    def __call__(self, ids, lengths, requests):
        action = self.plan[self.calls] if self.calls < len(self.plan) else "ok"
        self.calls += 1
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        rows = [(int(ids[bounds[i]]), int(lengths[i])) for i in range(len(lengths))]
        self.log.append((self.index, [n for n, _ in rows], action))
        if action == "slow":
            time.sleep(0.004)
        elif action == "raise":
            raise RuntimeError("injected")
        elif action == "short":
            return rows[:-1]
        elif action == "lost":
            self.restart(self.index)
            raise BackendLost("injected loss")
        return rows


request_st = st.tuples(
    st.lists(st.integers(1, 40), min_size=1, max_size=6),  # input lengths
    st.booleans(),  # priority lane
    st.floats(0, 0.004),  # pause before it arrives
    st.one_of(st.none(), st.floats(0, 0.006)),  # the client goes away after this long
)


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    requests=st.lists(request_st, min_size=1, max_size=16),
    plans=st.lists(st.lists(st.sampled_from(ACTIONS), max_size=10), min_size=1, max_size=3),
    reliable_first=st.booleans(),
    max_tokens=st.sampled_from([40, 64, 200]),
    lane_plans=st.one_of(st.none(), st.lists(st.sampled_from(ACTIONS), max_size=10)),
)
def test_every_admitted_input_is_answered_once_with_its_own_result(
    requests, plans, reliable_first, max_tokens, lane_plans
):
    """`lane_plans`: with priority lanes (backends len(plans)+i, replica i's), each following this plan."""
    if reliable_first and len(plans) > 1:
        plans[0] = []  # backend 0 never fails
    replicas = len(plans)
    lanes = None if lane_plans is None else [list(lane_plans) for _ in plans]
    if reliable_first and lanes and replicas > 1:
        lanes[0] = []  # replica 0 never fails
    log: list = []

    async def main():
        loop = asyncio.get_running_loop()

        def restart(index: int) -> None:  # on a compute thread
            loop.call_soon_threadsafe(loop.call_later, 0.003, batcher.backend_up, index)

        batcher = Batcher(
            [Fake(i, plan, log, restart) for i, plan in enumerate(plans)],
            max_tokens,
            8,
            "m",
            priority_batch_tokens=32,
            lanes=None
            if lanes is None
            else [Fake(replicas + i, p, log, restart) for i, p in enumerate(lanes)],
        )
        batcher.start()
        number = iter(range(1, 10**6))
        submitted = []
        for lengths, priority, pause, cancel_after in requests:
            await asyncio.sleep(pause)
            state = RequestState()
            seqs = []
            for n in lengths:
                k = next(number)
                seqs.append(Sequence([k] * n, loop.create_future(), state))
            batcher.submit(seqs, priority=priority)
            submitted.append((seqs, state))
            if cancel_after is not None:

                def cancel(seqs=seqs, state=state) -> None:  # what the engine does when a client leaves
                    state.cancelled = True
                    for s in seqs:
                        s.future.cancel()

                loop.call_later(cancel_after, cancel)
        futures = [s.future for seqs, _ in submitted for s in seqs]
        _, pending = await asyncio.wait(futures, timeout=10)
        assert not pending, f"{len(pending)} inputs never answered"
        owned = list(batcher._owned)
        await batcher.stop()
        return submitted, owned

    submitted, owned = asyncio.run(main())
    assert all(s.cancelled for s in owned)  # nothing answered is still held
    calls_of: dict[int, list[tuple[int, str]]] = {}
    for backend, numbers, action in log:
        for n in numbers:
            calls_of.setdefault(n, []).append((backend, action))
    for seqs, state in submitted:
        for s in seqs:
            n, calls = s.ids[0], calls_of.get(s.ids[0], [])
            assert len(calls) <= 2, (n, calls)  # one try and at most one retry
            assert sum(action in ("ok", "slow") for _, action in calls) <= 1, (n, calls)  # computed once
            if len(calls) == 2:  # the retry ran on another replica
                assert calls[0][0] % replicas != calls[1][0] % replicas, calls
            if s.future.cancelled():
                assert state.cancelled
                continue
            exc = s.future.exception()
            if exc is None:
                assert s.future.result() == (n, len(s.ids))  # its own result, so in order
            else:
                assert isinstance(exc, (RuntimeError, ShortResultError, BackendLost)), exc
                if reliable_first and len(plans) == 2 and not isinstance(exc, BackendLost):
                    raise AssertionError(f"input {n} failed although backend 0 never does: {calls}")


# --- priority lanes: each replica's second thread, for short requests beside a bulk batch ----------------


def test_a_short_request_is_answered_on_the_lane_while_every_replica_computes_bulk_work():
    """Both replicas are inside a bulk batch that does not end until the test says so: the short request
    is answered meanwhile, by a lane, in a batch of its own; the lanes never take bulk work."""
    a, b = Gated(), Gated()
    lane_a, lane_b = Backend(), Backend()

    async def main():
        batcher = Batcher([a, b], 4096, 256, "m", lanes=[lane_a, lane_b])
        bulk = await start_bulk(batcher, [a, b], [200] * 60)
        short = make(asyncio.get_running_loop(), [5, 7])
        batcher.submit(short, priority=True)
        got = await asyncio.gather(*(s.future for s in short))
        assert not a.release.is_set() and not b.release.is_set()  # both bulk batches still running
        a.release.set()
        b.release.set()
        await asyncio.gather(*(s.future for s in bulk))
        await batcher.stop()
        return got

    assert run(main()) == [5, 7]
    assert lane_a.batches + lane_b.batches == [[5, 7]]
    assert sum(map(len, a.batches + b.batches)) == 60  # all the bulk work, none of it on a lane


def test_a_lanes_batches_take_at_most_its_token_budget():
    """The lane's batch is the second one a worker holds beside its bulk batch: short requests queued
    while the replica computes bulk work reach the lane in batches of at most `lane_batch_tokens` tokens,
    all of them answered."""
    a, lane = Gated(), Gated()

    async def main():
        batcher = Batcher([a], 4096, 256, "m", lanes=[lane], lane_batch_tokens=64)
        bulk = await start_bulk(batcher, [a], [200] * 4)
        loop = asyncio.get_running_loop()
        first = make(loop, [30])
        batcher.submit(first, priority=True)
        await until(lane.started)  # the lane is inside its first batch; the rest queue behind it
        rest = [make(loop, [30]) for _ in range(9)]
        for short in rest:
            batcher.submit(short, priority=True)
        lane.release.set()
        got = await asyncio.gather(*(s.future for short in [first, *rest] for s in short))
        a.release.set()
        await asyncio.gather(*(s.future for s in bulk))
        await batcher.stop()
        return got

    assert run(main()) == [30] * 10
    # all ten on the lane (the replica's main thread is still inside its bulk batch), two to a batch
    assert sorted(map(len, lane.batches)) == [1, 1, 2, 2, 2, 2], lane.batches


def test_a_lane_waits_while_its_replica_computes_priority_work():
    """A lane runs beside bulk work only: while the only replica computes a short request's batch, the
    next short request waits for it (a second forward beside it would only share the core)."""
    a, lane = Gated(), Backend()

    async def main():
        batcher = Batcher([a], 4096, 256, "m", lanes=[lane])
        batcher.start()
        loop = asyncio.get_running_loop()
        first, second = make(loop, [5]), make(loop, [6])
        batcher.submit(first, priority=True)
        await until(a.started)
        batcher.submit(second, priority=True)
        for _ in range(20):  # the loop's turns in which a lane would have taken it
            await asyncio.sleep(0)
        assert not second[0].future.done() and not lane.batches
        a.release.set()
        await asyncio.gather(first[0].future, second[0].future)
        await batcher.stop()

    run(main())
    assert a.batches == [[5], [6]] and lane.batches == []


def test_a_lost_lane_takes_its_replica_out_and_its_batch_is_retried_on_another():
    """A lane that raises BackendLost (its worker died) takes its whole replica out of service, and its
    short request is retried on another replica."""
    a, b = Gated(), Gated()
    other_lane = Backend()

    def lost_lane(ids, lengths, requests):
        raise BackendLost("gone")

    async def main():
        batcher = Batcher([a, b], 4096, 256, "m", lanes=[lost_lane, other_lane])
        bulk = await start_bulk(batcher, [a, b], [200, 200])  # one sequence on each replica
        short = make(asyncio.get_running_loop(), [5])
        batcher.submit(short, priority=True)  # lane 0's loop is woken first and takes it
        while batcher._up[0]:
            await asyncio.sleep(0)
        down = list(batcher._up)
        b.release.set()  # replica 1 is free for the retry
        got = await asyncio.wait_for(short[0].future, 60)
        a.release.set()
        await asyncio.gather(*(s.future for s in bulk))
        await batcher.stop()
        return down, got

    down, got = run(main())
    assert down == [False, True, False, True]  # replica 0 and its lane, together
    assert got == 5 and [5] in b.batches and other_lane.batches == []
