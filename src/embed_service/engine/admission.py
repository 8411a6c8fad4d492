"""Admission: what a request may cost, checked before any of it is paid, and the capacity it holds.

One admission for every route that does work (embeddings, tokenize): the same limits, the same capacity.

Budgets, checked on the parsed request before tokenizing (a 400 names the one passed):
- inputs per request (``--max-client-batch-size``);
- characters per input the tokenizer may read, the prompt counted with each input (``--max-input-chars``);
- characters per request, the prompt counted once per input (``--max-request-chars``).
Token-id inputs are not tokenized; their ids count as characters. A chunked request's windows have a
budget of their own, counted as its texts are tokenized (engine/chunking.py).

Capacity is counted in inputs (``--max-concurrent-requests``), in two parts:
- a reserve (``--interactive-reserved-inputs``) that only interactive requests (at most
  ``--interactive-max-inputs`` inputs) take; a request admitted into it is *interactive*, and only
  interactive requests may take the priority lane. The priority lane thus never holds more than the
  reserve: splitting bulk work into many small requests wins at most the reserve, which every
  interactive client shares, and the rest is admitted as bulk work (or refused).
- the shared rest, which every request may take. A request larger than the free capacity is admitted
  *piecewise*: it holds a window of at least ``min(inputs, MIN_WINDOW)`` inputs, its inputs enter as its
  own earlier ones are answered, and the window grows as capacity frees, up to half the shared part
  (so a second large request finds room). It never waits for capacity it does not hold, so it cannot
  deadlock, and it is served on a busy server; a request that finds no room at all gets 429 at once.
A request whose inputs become more sequences once tokenized (a chunked request's windows) is re-admitted
for them (`Admission.resize`), so that a few long inputs run their windows side by side.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from embed_service.engine.errors import InvalidInputError, OverloadedError

MIN_WINDOW = 16  # inputs a piecewise request holds at least: enough to fill a batch now and then


@dataclass(frozen=True)
class Limits:
    """The per-request budgets (see the module docstring)."""

    max_inputs: int
    max_input_chars: int
    max_request_chars: int


def input_chars(item: str | Sequence[int], prompt: str | None, limit: int) -> int:
    """Characters of one input the tokenizer may read: prompt and text, at most `limit` (longer texts are
    cut or refused), or the number of ids of a token-id input."""
    if isinstance(item, str):
        return min(len(prompt or "") + len(item), limit)
    if not isinstance(item, (list, tuple)):  # an image (images.inputs.ImageInput): its own budgets
        return 0
    return len(item)


def check_request(inputs: Sequence[str] | Sequence[Sequence[int]], prompt: str | None, limits: Limits) -> int:
    """Refuse a request past a budget, before anything is tokenized. Returns its characters."""
    n = len(inputs)
    if n > limits.max_inputs:
        raise InvalidInputError(f"{n} inputs in one request; the limit is {limits.max_inputs}")
    if prompt and len(prompt) >= limits.max_input_chars:
        raise InvalidInputError(
            f"the prompt has {len(prompt)} characters; with the text, an input may have at most "
            f"{limits.max_input_chars} (--max-input-chars)",
            param="prompt",
        )
    total = sum(input_chars(item, prompt, limits.max_input_chars) for item in inputs)
    if total > limits.max_request_chars:
        what = f"with the prompt ({len(prompt)} characters) counted once per input, " if prompt else ""
        raise InvalidInputError(
            f"the {n} inputs make {total} characters to tokenize, {what}more than the limit of "
            f"{limits.max_request_chars} per request (--max-request-chars); send fewer or shorter inputs"
        )
    return total


class Admission:
    """The inputs admitted and not yet answered, on every route of one model (see the module docstring).

    Not thread-safe: used from the event loop only. `on_change(in_use)` runs after every change.
    """

    def __init__(
        self,
        capacity: int,
        reserved: int,
        interactive_max_inputs: int,
        name: str = "",
        on_change: Callable[[int], None] | None = None,
    ):
        self.capacity = capacity
        self.reserved = min(reserved, capacity // 4)
        self.shared = capacity - self.reserved
        self.interactive_max_inputs = interactive_max_inputs
        self.max_window = max(1, min(self.shared, max(MIN_WINDOW, self.shared // 2)))
        self.name = name
        self.in_reserve = 0
        self.in_shared = 0
        self.on_change = on_change

    @property
    def in_use(self) -> int:
        return self.in_reserve + self.in_shared

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self.in_use)

    def admit(self, n: int) -> Permit:
        """A permit for a request of `n` inputs, or OverloadedError when there is no room for it at all."""
        if n <= self.interactive_max_inputs and self.in_reserve + n <= self.reserved:
            self.in_reserve += n
            self._changed()
            return Permit(self, n, n, interactive=True)
        free = self.shared - self.in_shared
        window = min(n, free, self.max_window)
        if window < min(n, MIN_WINDOW, self.max_window):
            raise OverloadedError(
                f"model {self.name} is at capacity ({self.in_use} of {self.capacity} inputs "
                f"in progress); retry shortly"
            )
        self.in_shared += window
        self._changed()
        return Permit(self, n, window, interactive=False)

    def resize(self, permit: Permit, units: int) -> None:
        """Re-admit an idle permit for `units` inputs, now that the request knows how many it has (a chunked
        request's windows, once planned): into the reserve as `admit(units)` would, else into the shared part
        with as many slots as are free there (its own counted as free), which then grow as a piecewise
        request's do; in one step, so the count never passes through a value nobody holds. Where the shared
        part has fewer free slots than the permit holds, it keeps what it holds and `units` enter
        through it."""
        assert permit.busy == 0 and not permit.closed and units >= 0
        permit.unstarted = units
        in_reserve = self.in_reserve - (permit.held if permit.interactive else 0)
        in_shared = self.in_shared - (0 if permit.interactive else permit.held)
        if units <= self.interactive_max_inputs and in_reserve + units <= self.reserved:
            interactive, held = True, units
        else:
            held = min(units, self.shared - in_shared, self.max_window)
            interactive = False
            if held < max(1, permit.held):
                return  # less room than it holds
        self.in_reserve, self.in_shared = in_reserve, in_shared
        if interactive:
            self.in_reserve += held
        else:
            self.in_shared += held
        permit.interactive, permit.held = interactive, held
        self._changed()

    def _grow(self, permit: Permit, want: int) -> int:
        if permit.interactive:
            return 0
        extra = min(want, self.shared - self.in_shared, self.max_window - permit.held)
        if extra <= 0:
            return 0
        self.in_shared += extra
        self._changed()
        return extra

    def _release(self, permit: Permit, k: int) -> None:
        if permit.interactive:
            self.in_reserve -= k
        else:
            self.in_shared -= k
        assert self.in_reserve >= 0 and self.in_shared >= 0
        self._changed()


class Permit:
    """The capacity one request holds: `held` input slots, `busy` of them with an input in progress.

    The request starts an input only on a free slot (`take`), and calls `done` when one is answered:
    the slot is reused for the request's next input, or handed back when none is left to start.
    `close` hands back everything (the request ended: answered, failed or cancelled); later calls are
    no-ops, so a late callback cannot release twice.
    """

    def __init__(self, admission: Admission, inputs: int, held: int, interactive: bool):
        self.admission = admission
        self.interactive = interactive
        self.unstarted = inputs
        self.held = held
        self.busy = 0
        self.closed = False

    def free(self) -> int:
        """Slots free for this request's next inputs now, after taking what the admission can spare."""
        if self.closed:
            return 0
        want = self.unstarted - (self.held - self.busy)
        if want > 0:
            self.held += self.admission._grow(self, want)
        return min(self.unstarted, self.held - self.busy)

    def extend(self, k: int) -> None:
        """`k` more inputs for this request to start (the further windows of a chunked input)."""
        assert k >= 0 and not self.closed
        self.unstarted += k

    def take(self, k: int) -> None:
        assert not self.closed and k <= self.held - self.busy and k <= self.unstarted
        self.busy += k
        self.unstarted -= k

    def done(self, k: int = 1) -> None:
        if self.closed:
            return
        self.busy -= k
        spare = self.held - self.busy - self.unstarted  # slots no input of this request will need
        if spare > 0:
            self.held -= spare
            self.admission._release(self, spare)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.held:
            self.admission._release(self, self.held)
        self.held = self.busy = 0


async def run_piecewise(
    permit: Permit, n: int, start: Callable[[int, int], Awaitable[list[asyncio.Future]]]
) -> list[Any]:
    """Answer a request of `n` inputs through its permit, in order.

    `start(first, k)` starts inputs first..first+k-1 (tokenize, enqueue) and returns their futures. As many
    inputs start as the permit has free slots; the rest enter as this request's earlier inputs are
    answered (and as the permit grows when capacity frees). The caller closes the permit.
    """
    futures: list[asyncio.Future] = []
    slots = Slots(permit)
    while len(futures) < n:
        k = await slots.free()
        if slots.failed:  # after a failure the request fails: start nothing more
            break
        permit.take(k)
        started = await start(len(futures), k)
        for future in started:
            slots.watch(future)
        futures += started
    return await asyncio.gather(*futures)


class Slots:
    """A permit's slots as a request's loop starts inputs on them: each answered input frees one."""

    def __init__(self, permit: Permit):
        self.permit = permit
        self.failed = False  # an answered input failed (or was cancelled)
        self._freed = asyncio.Event()

    def watch(self, future: asyncio.Future) -> None:
        future.add_done_callback(self._answered)

    def _answered(self, future: asyncio.Future) -> None:
        self.failed = self.failed or future.cancelled() or future.exception() is not None
        self.permit.done(1)
        self._freed.set()

    async def free(self) -> int:
        """Slots free now; when none is, waits until one of the request's own inputs is answered (one is
        in progress, since the permit holds at least one slot), or a failure is noted."""
        while not self.failed:
            k = self.permit.free()
            if k:
                return k
            self._freed.clear()
            await self._freed.wait()
        return 0
