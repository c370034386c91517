"""Blocking generation in threads, consumed from asyncio.

Each choice of a request runs its `stream_reply` iterator in a thread of its own (the
model's scheduler batches all of them with every other request in flight); chunks reach
the event loop through an asyncio queue. Setting the request's stop event (a client that
disconnects, or the consumer closing early) makes each thread stop at its next token and
close the model's stream, which cancels the job in the scheduler and frees its pages.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator

from fastapi import Request

from webui.text_generation import ReplyChunk

ChunkSource = Callable[[], Iterator[ReplyChunk]]
_DONE = object()


class ChoiceRunner:
    def __init__(self, sources: list[ChunkSource], stop: threading.Event) -> None:
        self.stop = stop
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
        self._open = len(sources)
        self._threads = [
            threading.Thread(target=self._work, args=(i, src), name=f"api-choice-{i}", daemon=True)
            for i, src in enumerate(sources)
        ]
        for thread in self._threads:
            thread.start()

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
            if stream is not None:
                close = getattr(stream, "close", None)
                if close is not None:
                    close()
            self._post((index, _DONE))

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
