"""The request actor without a model: what the client sees of each update."""

from __future__ import annotations

from stepline.actors.mailbox import Mailbox
from stepline.actors.messages import Update
from stepline.actors.request import RequestActor
from stepline.events.models import FinishReason


class Letters:
    """A detokenizer whose token t is the letter chr(t)."""

    def add(self, token_id: int) -> str:
        return chr(token_id)

    def finalize(self) -> str:
        return ""


def actor(stop: tuple[str, ...] = (), ended: list[FinishReason] | None = None) -> RequestActor:
    return RequestActor(
        "r",
        num_prompt_tokens=4,
        stop=stop,
        detokenizer=Letters(),
        inbox=Mailbox(),
        output=Mailbox(),
        on_end=(ended if ended is not None else []).append,
    )


def test_the_output_count_is_the_one_the_core_sent() -> None:
    a = actor()
    out = a.on_update(Update(token_ids=[ord("h")], num_output_tokens=1))
    assert out is not None and (out.text, out.num_output_tokens) == ("h", 1)
    # The core's count, not the tokens this actor happened to see.
    out = a.on_update(Update(token_ids=[ord("i")], num_output_tokens=5))
    assert out is not None and (out.text, out.num_output_tokens) == ("i", 5)
    end = a.on_update(Update(num_output_tokens=5, finish=FinishReason.CANCELLED, message="gone"))
    assert end is not None and end.finish_reason == "cancelled" and end.num_output_tokens == 5


def test_a_stop_string_ends_the_request_with_the_count_of_the_step_that_found_it() -> None:
    ended: list[FinishReason] = []
    a = actor(stop=("lo",), ended=ended)
    out = a.on_update(Update(token_ids=[ord("h"), ord("e")], num_output_tokens=2))
    assert out is not None and out.finish_reason is None
    out = a.on_update(Update(token_ids=[ord("l")], num_output_tokens=3))
    assert out is not None and out.text == "" and out.finish_reason is None  # "l" held back
    out = a.on_update(Update(token_ids=[ord("o")], num_output_tokens=4))
    assert out is not None and out.text == "" and out.finish_reason == "stop"
    assert out.num_output_tokens == 4 and ended == [FinishReason.STOP]


def test_a_driven_actor_says_at_once_that_its_stop_string_ended_the_request() -> None:
    output: Mailbox = Mailbox()
    a = RequestActor(
        "r", num_prompt_tokens=4, stop=("lo",), detokenizer=Letters(), inbox=None, output=output
    )
    assert a.take(Update(token_ids=[ord("h"), ord("l")], num_output_tokens=2)) is None
    assert a.take(Update(token_ids=[ord("o")], num_output_tokens=3)) is FinishReason.STOP
    last = [output.get_nowait(), output.get_nowait()][-1]
    assert (last.finish_reason, last.num_output_tokens) == ("stop", 3) and output.closed
    # An end the core decided is the core's to record: the actor only shows it.
    b = RequestActor(
        "s", num_prompt_tokens=4, stop=("lo",), detokenizer=Letters(), inbox=None, output=Mailbox()
    )
    assert b.take(Update(num_output_tokens=1, finish=FinishReason.LENGTH)) is None
