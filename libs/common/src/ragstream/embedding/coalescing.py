"""Packs the embed calls of many documents into full provider batches, a bounded number in flight.

Each document still asks for its own chunks' vectors and commits them in its own transaction; only
the calls to the provider are shared. Why: a provider's cost is per call (a USE forward pass, a
DashScope request), and one document's chunks rarely fill a call (docs/ingest.md).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ragstream.embedding.base import Embedder, EmbeddingError, TextKind, Vectors

__all__ = ["BatchLimits", "CoalescingEmbedder", "batch_limits"]


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """How a provider is best called: ``batch_size`` texts per call, ``max_in_flight`` calls at once.

    ``linger_s`` is how long a free call slot waits for more texts before it goes out part-full.
    """

    batch_size: int
    max_in_flight: int = 1
    linger_s: float = 0.02

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.max_in_flight < 1:
            raise ValueError("batch_size and max_in_flight must be at least 1")
        if self.linger_s < 0:
            raise ValueError("linger_s must not be negative")


def batch_limits(embedder: Embedder) -> BatchLimits | None:
    """The limits an embedder declares (its ``batch_limits`` attribute), or None: then it is called
    as is, one document's texts per call."""
    declared = getattr(embedder, "batch_limits", None)
    return declared if isinstance(declared, BatchLimits) else None


@dataclass(eq=False)
class _Request:
    """One caller's texts, the rows filled in so far and the future its caller waits on."""

    texts: list[str]
    future: asyncio.Future[Vectors]
    vectors: Vectors
    next_text: int = 0  # the first text not yet handed to a call
    missing: int = 0  # texts handed out whose vectors have not come back

    @property
    def open(self) -> bool:
        return not self.future.done()


@dataclass(frozen=True, slots=True)
class _Part:
    request: _Request
    start: int
    stop: int


class CoalescingEmbedder:
    """An ``Embedder`` whose document calls share provider calls of ``limits.batch_size`` texts.

    A call's texts are queued; a dispatcher hands the queue out in batches of ``batch_size``, at most
    ``max_in_flight`` at a time, and a slot that frees up waits up to ``linger_s`` for a full batch.
    A batch may hold the texts of several callers and one caller's texts may span batches; each
    caller gets exactly its own rows back, in order. Query embeddings are not queued: a search must
    not wait for a batch to fill.

    Failures stay per caller: a retryable failure (the provider down after its own retries) fails
    every caller in that batch, as it would have failed each of them alone; a permanent one (the
    provider refused an input) is retried once per caller alone, so only the caller whose text was
    refused sees it. ``aclose`` closes this wrapper, not ``inner``, which its owner closes.
    """

    def __init__(self, inner: Embedder, limits: BatchLimits) -> None:
        self.inner = inner
        self.limits = limits
        self._queue: deque[_Request] = deque()
        self._queued = 0  # texts in the queue not yet handed out
        # Calls in flight outlive the dispatcher that sent them: the next one counts them too.
        self._in_flight: set[asyncio.Task[None]] = set()
        self._arrived: asyncio.Event | None = None  # made on the running loop with each dispatcher
        self._dispatcher: asyncio.Task[None] | None = None

    @property
    def model_key(self) -> str:
        return self.inner.model_key

    @property
    def dimension(self) -> int:
        return self.inner.dimension

    async def warm_up(self) -> None:
        await self.inner.warm_up()

    async def embed(self, texts: Sequence[str], kind: TextKind = "document") -> Vectors:
        if kind != "document" or not texts:
            return await self.inner.embed(texts, kind)
        loop = asyncio.get_running_loop()
        request = _Request(
            list(texts), loop.create_future(), np.zeros((len(texts), self.inner.dimension), dtype=np.float32)
        )
        self._queue.append(request)
        self._queued += len(texts)
        if self._dispatcher is None or self._dispatcher.done():
            self._arrived = asyncio.Event()
            self._dispatcher = asyncio.create_task(self._dispatch(self._arrived))
        elif self._arrived is not None:
            self._arrived.set()
        try:
            return await request.future
        except asyncio.CancelledError:
            request.future.cancel()  # its texts not handed out yet are skipped
            raise

    async def _dispatch(self, arrived: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        while self._queued > 0:
            while len(in_flight := self._calls_in_flight(loop)) >= self.limits.max_in_flight:
                await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
            deadline = loop.time() + self.limits.linger_s
            while self._queued < self.limits.batch_size and (left := deadline - loop.time()) > 0:
                arrived.clear()
                try:
                    async with asyncio.timeout(left):
                        await arrived.wait()
                except TimeoutError:
                    break
            parts = self._take()
            if parts:
                task = asyncio.create_task(self._call(parts))
                self._in_flight.add(task)
                task.add_done_callback(self._in_flight.discard)
        # Returns with calls still in flight: the next caller starts a dispatcher that waits for them.

    def _calls_in_flight(self, loop: asyncio.AbstractEventLoop) -> set[asyncio.Task[None]]:
        """The calls running on ``loop``; one left on a loop that closed (a test's) holds no slot."""
        return {task for task in self._in_flight if task.get_loop() is loop and not task.done()}

    def _take(self) -> list[_Part]:
        """Up to ``batch_size`` queued texts, oldest caller first; cancelled callers are dropped."""
        parts: list[_Part] = []
        room = self.limits.batch_size
        while room and self._queue:
            request = self._queue[0]
            left = len(request.texts) - request.next_text
            if not request.open:
                self._queue.popleft()
                self._queued -= left
                continue
            take = min(room, left)
            parts.append(_Part(request, request.next_text, request.next_text + take))
            request.next_text += take
            request.missing += take
            self._queued -= take
            room -= take
            if request.next_text == len(request.texts):
                self._queue.popleft()
        return parts

    async def _call(self, parts: list[_Part]) -> None:
        texts = [text for part in parts for text in part.request.texts[part.start : part.stop]]
        try:
            vectors = await self.inner.embed(texts, "document")
        except EmbeddingError as error:
            if error.retryable or len({id(part.request) for part in parts}) == 1:
                self._fail(parts, error)
            else:
                await self._alone(parts)
            return
        except asyncio.CancelledError:
            self._fail(parts, None)
            raise
        except Exception as error:  # a broken provider: every caller in the batch learns why
            self._fail(parts, error)
            return
        self._deliver(parts, vectors)

    async def _alone(self, parts: list[_Part]) -> None:
        """Each caller's part of a refused batch again on its own, so the refusal lands on its owner."""

        async def one(part: _Part) -> None:
            try:
                vectors = await self.inner.embed(part.request.texts[part.start : part.stop], "document")
            except Exception as error:  # reported to that part's caller only
                self._fail([part], error)
            else:
                self._deliver([part], vectors)

        await asyncio.gather(*(one(part) for part in parts))

    def _deliver(self, parts: list[_Part], vectors: Vectors) -> None:
        row = 0
        for part in parts:
            count = part.stop - part.start
            request = part.request
            if request.open:
                request.vectors[part.start : part.stop] = vectors[row : row + count]
                request.missing -= count
                if request.missing == 0 and request.next_text == len(request.texts):
                    request.future.set_result(request.vectors)
            row += count

    def _fail(self, parts: list[_Part], error: BaseException | None) -> None:
        for part in parts:
            request = part.request
            if request.open:
                if error is None:
                    request.future.cancel()
                else:
                    request.future.set_exception(error)

    async def aclose(self) -> None:
        if self._dispatcher is not None:
            self._dispatcher.cancel()
        for task in list(self._in_flight):
            task.cancel()
