"""The one bridge between a worker thread and the event loop, for every route: the worker runs on a thread of the
pool (generation blocks), its items reach the loop as they come, a stream writes whatever is ready in one write, a
client that leaves stops the worker at its next item, and what the worker holds (a generation slot) is released when
it ends, whoever stops first."""

import asyncio
import json
import threading

from starlette.concurrency import run_in_threadpool

END = object()  # queued once the worker has ended, after every item it emitted


async def when_gone(request, then):
    """Call then() once the client has closed the connection (uvicorn answers receive() with http.disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    then()


class Worker:
    """work(emit, cancelled) started at once on a thread: it emits its items and should return soon after cancelled
    is set. Each on_end(worker) runs on the loop once it has ended, however it ended (even if no one ever read it).
    request: the client's request, watched so that a client that leaves cancels the work."""

    def __init__(self, work, on_end=(), request=None):
        loop = asyncio.get_running_loop()
        self.items, self.cancelled = asyncio.Queue(), threading.Event()
        emit = lambda item: loop.call_soon_threadsafe(self.items.put_nowait, item)  # noqa: E731 - from the thread
        self.future = asyncio.ensure_future(run_in_threadpool(work, emit, self.cancelled))
        for callback in on_end:
            self.future.add_done_callback(lambda _, callback=callback: callback(self))
        self.future.add_done_callback(lambda _: self.items.put_nowait(END))
        if request is not None:
            watcher = asyncio.ensure_future(when_gone(request, self.cancelled.set))
            self.future.add_done_callback(lambda _: watcher.cancel())

    def error(self):
        """The exception the work raised, or None (once it has ended)."""
        return None if self.future.cancelled() else self.future.exception()

    async def batches(self):
        """(the items ready, whether the worker has ended) as they come, until it has; a consumer that stops early
        cancels the work."""
        try:
            ended = False
            while not ended:
                items = [await self.items.get()]
                while not self.items.empty():
                    items.append(self.items.get_nowait())
                ended = items[-1] is END
                yield (items[:-1] if ended else items), ended
        finally:
            self.cancelled.set()

    async def events(self, event, last=lambda: [], first=()):
        """Server-sent events: first at once, event(item) per item, then last() and data: [DONE]; a worker that failed
        mid-stream ends it with an error event instead (the status line said 200: the stream is the only place left to
        say it). Every event ready goes in one write, and the await between writes lets a closed connection be noticed
        before the next (asyncio logs "socket.send() raised exception." from the fifth write after)."""
        if first:
            yield "".join(f"data: {json.dumps(e)}\n\n" for e in first)
        async for items, ended in self.batches():
            events = [event(item) for item in items]
            if ended:
                error = self.error()
                events += [{"error": {"message": f"generation failed: {error}", "type": "server_error"}}] if error \
                    else [*last(), "[DONE]"]
            yield "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events)

    async def finished(self):
        """Every item, once the worker has ended (a non-streamed answer); None when the client left first. A failure
        of the work is raised here."""
        await asyncio.shield(self.future)  # a cancelled handler must not cancel the thread: cancelled stops it
        if self.cancelled.is_set():
            return None
        items = []
        while (item := await self.items.get()) is not END:
            items.append(item)
        return items
