"""What a client is told when a request fails (api/pipeline/errors.py `known_error`): the
client's mistakes, raised as explicit types, are 4xx that say what to change; anything else,
a plain ValueError included, is no 4xx (the caller answers a 500 and logs the traceback)."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ValidationError

from stepline.api.json_limits import InputLimitError
from stepline.api.params import SamplingParams
from stepline.api.pipeline.errors import known_error
from stepline.api.request_error import RequestError


def test_a_request_error_is_a_400_naming_the_prompt_field():
    err = known_error(RequestError("the chat template refused the messages: no system"))

    assert err is not None and err.status_code == 400
    assert err.param == "messages"
    assert err.message == "messages: the chat template refused the messages: no system"


def test_a_request_error_names_its_own_field_where_it_has_one():
    err = known_error(RequestError("must be a token id", param="stop_token_ids"), prompt_param="x")

    assert err is not None and err.status_code == 400 and err.param == "stop_token_ids"


@pytest.mark.parametrize(
    "bug",
    [ValueError("max() arg is an empty sequence"), KeyError("rows"), RuntimeError("boom")],
    ids=["ValueError", "KeyError", "RuntimeError"],
)
def test_an_unexpected_exception_is_not_blamed_on_the_client(bug):
    assert known_error(bug) is None


def test_the_vocabulary_check_and_a_bad_token_id_are_request_errors():
    with pytest.raises(RequestError, match="top_k must be at most"):
        SamplingParams(top_k=50).check_vocabulary(10)
    with pytest.raises(RequestError, match="stop_token_ids must be in"):
        SamplingParams(stop_token_ids=(12,)).check_vocabulary(10)


def test_validation_and_input_limits_keep_their_400s():
    class Body(BaseModel):
        n: int

    with pytest.raises(ValidationError) as caught:
        Body.model_validate({"n": "x"})
    invalid = known_error(caught.value)
    limit = known_error(InputLimitError("too deep", param="tools", code="too_deep"))

    assert invalid is not None and invalid.status_code == 400 and invalid.param == "n"
    assert limit is not None and (limit.status_code, limit.code) == (400, "too_deep")
