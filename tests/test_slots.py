"""Generation slots shared fairly among clients (nanochat/serve/slots.py), on an event loop of the test's own."""

import asyncio

import pytest

from nanochat.serve.slots import Busy, Slots


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, timeout=10))  # a scheduling bug fails the test, never hangs it


def test_a_client_holds_at_most_its_share_and_another_starts_at_once():
    async def scenario():
        slots = Slots(4, per_client=3)
        for _ in range(3):
            await slots.acquire("a", timeout=0)
        with pytest.raises(Busy) as busy:  # a slot is free, but not for a
            await slots.acquire("a", timeout=0)
        assert busy.value.reason == "max_concurrency_per_client"
        assert "--max_concurrency_per_client" in str(busy.value) and "3 generations" in str(busy.value)
        await slots.acquire("b", timeout=0)  # the slot a may not take is b's at once
        with pytest.raises(Busy) as busy:
            await slots.acquire("c", timeout=0)
        assert busy.value.reason == "max_concurrency" and "4 generations running" in str(busy.value)
        assert slots.busy == 4 and dict(slots.running) == {"a": 3, "b": 1}
    run(scenario())


def test_a_freed_slot_goes_to_the_client_running_fewest_then_the_earliest():
    """a holds both slots; a, b, b and c wait in that order. First come, first served would give a, b, b, c."""
    async def scenario():
        slots, granted = Slots(2), []
        await slots.acquire("a")
        await slots.acquire("a")

        async def wait(client, name):
            await slots.acquire(client, timeout=5)
            granted.append(name)

        tasks = []
        for client, name in [("a", "a3"), ("b", "b1"), ("b", "b2"), ("c", "c1")]:
            tasks.append(asyncio.create_task(wait(client, name)))
            await asyncio.sleep(0)  # it is waiting before the next arrives
        assert len(slots.waiters) == 4
        for client in ["a", "a", "a", "b"]:  # each frees a slot its client holds
            slots.release(client)
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        # b1 (b runs 0, a 1); a3 (a runs 0 and came before c); c1 (c runs 0, b 1); b2
        assert granted == ["b1", "a3", "c1", "b2"]
        assert slots.busy == 2 and not slots.waiters
    run(scenario())


def test_a_request_of_a_client_at_its_share_waits_while_others_take_free_slots():
    async def scenario():
        slots = Slots(3, per_client=1)
        await slots.acquire("a")
        waiting = asyncio.create_task(slots.acquire("a", timeout=5))
        await asyncio.sleep(0)
        await slots.acquire("b", timeout=0)  # a's waiter may not take the free slot: b may
        assert not waiting.done() and slots.busy == 2
        slots.release("a")
        await waiting  # a's own slot freed: its waiter takes it
        assert dict(slots.running) == {"a": 1, "b": 1}
    run(scenario())


def test_a_wait_ends_in_busy_after_the_timeout_and_a_cancelled_wait_holds_nothing():
    async def scenario():
        slots = Slots(1)
        await slots.acquire("a")
        with pytest.raises(Busy) as busy:
            await slots.acquire("b", timeout=0.05)
        assert busy.value.reason == "max_concurrency" and not slots.waiters
        left = asyncio.create_task(slots.acquire("c", timeout=5))  # its client goes away while it waits
        await asyncio.sleep(0)
        left.cancel()
        with pytest.raises(asyncio.CancelledError):
            await left
        assert not slots.waiters
        # given the slot and cancelled before it could run: the slot goes back
        late = asyncio.create_task(slots.acquire("d", timeout=5))
        await asyncio.sleep(0)
        slots.release("a")  # grants d's wait
        late.cancel()
        with pytest.raises(asyncio.CancelledError):
            await late
        assert slots.busy == 0 and not slots.waiters
        await slots.acquire("e", timeout=0)  # free again
    run(scenario())


def test_a_share_larger_than_the_total_is_refused():
    with pytest.raises(ValueError, match="per_client=5: must be from 1 to total=4"):
        Slots(4, per_client=5)
