"""The mailbox between the step loop, request actors and clients: nothing lost, nothing
out of order, and an end that every reader sees."""

import asyncio

import anyio
import pytest

from stepline.actors.mailbox import Mailbox


async def test_messages_arrive_in_order_and_those_sent_before_close_are_still_read():
    box: Mailbox[int] = Mailbox()
    for i in range(3):
        assert box.put(i)
    box.close()
    assert not box.put(3)  # nothing after the end
    assert [await box.get() for _ in range(3)] == [0, 1, 2]
    for _ in range(2):  # every later read ends too
        with pytest.raises(anyio.EndOfStream):
            await box.get()
    with pytest.raises(anyio.EndOfStream):
        box.get_nowait()


async def test_a_waiting_reader_wakes_for_the_next_message_and_for_the_end():
    box: Mailbox[str] = Mailbox()
    reader = asyncio.create_task(box.get())
    await anyio.wait_all_tasks_blocked()  # the reader waits for a message
    assert not reader.done()
    box.put("a")
    assert await reader == "a"
    reader = asyncio.create_task(box.get())
    await anyio.wait_all_tasks_blocked()  # the reader waits for a message
    box.close()
    with pytest.raises(anyio.EndOfStream):
        await reader


async def test_a_read_given_up_on_loses_no_message():
    """A client that stops waiting (a timeout around its read) and reads again later gets
    every message, the one that came meanwhile first."""
    box: Mailbox[int] = Mailbox()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(box.get(), 0.01)
    box.put(1)
    box.put(2)
    assert box.get_nowait() == 1
    assert await box.get() == 2
    with pytest.raises(anyio.WouldBlock):
        box.get_nowait()
