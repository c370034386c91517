"""Blocking generation in threads, consumed from asyncio.

Each choice of a request runs its `stream_reply` iterator in a thread of its own (the
model's scheduler batches all of them with every other request in flight); chunks reach
the event loop through an asyncio queue. The threads are bounded: a request may hold at
most MAX_CHOICES_PER_REQUEST choices (prompts x n; more is a 400) and the server at most
MAX_CHOICE_THREADS at once (a request that would pass it is a 429 before any thread
starts), so no request creates threads in proportion to its size.

Setting the request's stop event (a client that disconnects, or the consumer closing
early) makes each thread stop at its next token and close the model's stream, which
cancels the job in the scheduler and frees its pages.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator

from fastapi import Request

from extensions.openai.errors import ApiError
from serving.text_generation import ReplyChunk

ChunkSource = Callable[[], Iterator[ReplyChunk]]
_DONE = object()
# Choices of one request (OpenAI's n is at most 128); and threads of the whole server, well
# above any real batch (the scheduler runs max_batch jobs, 64 by default, the rest wait).
MAX_CHOICES_PER_REQUEST = 128
MAX_CHOICE_THREADS = 512


class ChoiceSlots:
    """A count of choice threads in flight, taken all at once per request or not at all."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    def take(self, count: int) -> bool:
        with self._lock:
            if self.used + count > self.limit:
                return False
            self.used += count
            return True

    def give(self, count: int = 1) -> None:
        with self._lock:
            self.used -= count


slots = ChoiceSlots(MAX_CHOICE_THREADS)


def check_choice_count(prompts: int, n: int) -> None:
    """A 400 when a request asks for more choices than one request may hold."""
    if prompts * n > MAX_CHOICES_PER_REQUEST:
        raise ApiError(
            400,
            f"{prompts} prompt(s) x n={n} = {prompts * n} choices; one request may ask for at "
            f"most {MAX_CHOICES_PER_REQUEST} (send fewer prompts per request, or a smaller n)",
            param="prompt" if prompts > 1 else "n",
            code="too_many_choices",
        )


class ChoiceRunner:
    def __init__(self, sources: list[ChunkSource], stop: threading.Event) -> None:
        if not slots.take(len(sources)):
            raise ApiError(
                429,
                f"the server is running {slots.used} choices, its limit is {slots.limit}: "
                "retry later",
                type="server_error",
                code="too_many_requests",
            )
        self.stop = stop
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
        self._open = len(sources)
        self._threads = [
            threading.Thread(target=self._work, args=(i, src), name=f"api-choice-{i}", daemon=True)
            for i, src in enumerate(sources)
        ]
        for started, thread in enumerate(self._threads):
            try:
                thread.start()
            except RuntimeError as error:  # the OS refused a thread: end the ones started
                stop.set()
                slots.give(len(self._threads) - started)
                self._open = started
                raise ApiError(
                    503, f"cannot start a generation thread ({error})", type="server_error"
                ) from None

    def _post(self, item: tuple[int, object]) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop is gone (server shutting down): nobody listens
            self.stop.set()

    def _work(self, index: int, source: ChunkSource) -> None:
        stream = None
        try:
            stream = source()
            for chunk in stream:
                self._post((index, chunk))
        except BaseException as error:  # delivered to the consumer, which answers with it
            self._post((index, error))
        finally:
            try:
                if stream is not None:
                    close = getattr(stream, "close", None)
                    if close is not None:
                        close()
                self._post((index, _DONE))
            finally:
                slots.give()

    async def chunks(self) -> AsyncIterator[tuple[int, ReplyChunk]]:
        """(choice index, chunk) in arrival order; raises the first error of any choice."""
        try:
            while self._open:
                index, item = await self._queue.get()
                if item is _DONE:
                    self._open -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    assert isinstance(item, ReplyChunk)
                    yield index, item
        finally:
            # Whatever ends the consumer (done, an error, a disconnect): stop the others.
            self.stop.set()


async def watch_disconnect(request: Request, stop: threading.Event) -> None:
    """Sets `stop` when the client goes away (run as a task beside the response)."""
    while not stop.is_set():
        if await request.is_disconnected():
            stop.set()
            return
        await asyncio.sleep(0.1)
