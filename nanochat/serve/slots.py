"""Generation slots shared fairly among clients (Slots): at most `total` generations at once, at most `per_client` of
them one client's, and a slot that frees goes to the waiting client with the fewest generations running, the one
waiting longest among equals. A client's many requests therefore cannot hold another's waiting: it never holds more
than per_client slots, so total - per_client stay for the others, and when every slot is taken the next one goes to
whoever runs least. asyncio.Semaphore, which the server used before, serves waiters in arrival order only."""

import asyncio
import itertools
from collections import Counter
from typing import NamedTuple


class Busy(Exception):
    """No slot came within the wait: reason is the cap that held the request (max_concurrency or
    max_concurrency_per_client); the message says which, for the 503."""

    def __init__(self, reason, message):
        super().__init__(message)
        self.reason = reason


class Waiter(NamedTuple):
    arrival: int
    client: str
    granted: asyncio.Future  # its result is set when dispatch gives it a slot


class Slots:
    """The slots; all methods run on the event loop."""

    def __init__(self, total, per_client=None):
        if not 1 <= (per_client or total) <= total:
            raise ValueError(f"per_client={per_client}: must be from 1 to total={total}")
        self.total, self.per_client = total, per_client or total
        self.running = Counter()  # generations running, by client (only clients running one)
        self.waiters = []  # in arrival order
        self.arrivals = itertools.count()

    @property
    def busy(self):
        """Generations running."""
        return self.running.total()

    def free_for(self, client):
        return self.busy < self.total and self.running[client] < self.per_client

    async def acquire(self, client, timeout=None):
        """Take a slot for client: at once if one is free for it, else wait up to timeout seconds (None: for ever;
        0: no waiting) for dispatch to give it one; Busy when none came."""
        if self.free_for(client):  # no waiter could take it: dispatch gives every free slot a waiter can take
            self.running[client] += 1
            return
        if timeout == 0:
            raise self.refusal(client)
        waiter = Waiter(next(self.arrivals), client, asyncio.get_running_loop().create_future())
        self.waiters.append(waiter)
        try:
            # asyncio.wait, not wait_for: wait_for of Python 3.11 returns a result that came as its task was cancelled
            done, _ = await asyncio.wait([waiter.granted], timeout=timeout)
        except asyncio.CancelledError:  # the request is gone
            if waiter.granted.done():  # given a slot as it went: the slot goes on
                self.release(client)
            else:
                self.waiters.remove(waiter)
            raise
        if not done:
            self.waiters.remove(waiter)
            raise self.refusal(client)

    def release(self, client):
        self.running[client] -= 1
        if not self.running[client]:
            del self.running[client]
        self.dispatch()

    def dispatch(self):
        """Give free slots to waiters that may take one: the client running fewest first, then the earliest."""
        while self.busy < self.total:
            ready = [w for w in self.waiters if self.running[w.client] < self.per_client]
            if not ready:
                return
            chosen = min(ready, key=lambda w: (self.running[w.client], w.arrival))
            self.waiters.remove(chosen)
            self.running[chosen.client] += 1
            chosen.granted.set_result(None)

    def refusal(self, client):
        if self.running[client] >= self.per_client:
            return Busy("max_concurrency_per_client", f"server busy: your address runs {self.per_client} "
                                                      f"generations, the most one client may "
                                                      f"(--max_concurrency_per_client); retry when one has ended")
        return Busy("max_concurrency", f"server busy: {self.total} generations running; retry later")
