"""Property-based fuzzing (hypothesis) of the app's parsers: the OpenAI request parser, the stop
string hold-back of streamed answers, and conversation import. Whatever arrives, they answer with
their documented errors (an OpenAI-shaped 4xx, a one-line ValueError), never anything else."""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import test_app_support as support
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.api import openai_api

from app.api import openai_requests
from app.views.conversation import export_conversation, import_conversation
from app.serving.pair import make_engine
from app.serving.worker import Worker

EXAMPLES = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                            HealthCheck.function_scoped_fixture])
MODEL = "tiny-target"

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20)
roles = st.sampled_from(["system", "developer", "user", "assistant", "tool", "", "USER", None])
contents = st.text(max_size=40) | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                                  "text": st.text(max_size=10)}), max_size=3) | json_values
messages = st.lists(st.fixed_dictionaries({"role": roles, "content": contents}), max_size=5)
fields = {"model": st.sampled_from([MODEL, "gpt-4o", None, 3]), "messages": messages | json_values,
          "temperature": json_values | st.floats(0, 2), "top_p": json_values | st.floats(0, 1),
          "max_tokens": json_values | st.integers(-5, 10**6), "seed": json_values, "stop": json_values
          | st.lists(st.text(max_size=300), max_size=6), "stream": json_values, "n": json_values,
          "stream_options": json_values, "user": json_values, "sequoia": json_values
          | st.fixed_dictionaries({"tree_size": json_values, "depth": json_values, "method": json_values}),
          "response_format": json_values, "frequency_penalty": json_values}
bodies = st.fixed_dictionaries({}, optional=fields) | json_values


@pytest.fixture(scope="module")
def worker():
    tokenizer = support.tokenizer()
    target, draft = support.tiny_pair()
    w = Worker(make_engine(target, draft, tokenizer), tokenizer, {"target": MODEL, "draft": "tiny-draft"})
    yield w
    w.close()


@EXAMPLES
@given(body=bodies)
def test_any_request_body_is_a_call_or_an_openai_error(worker, body):
    try:
        call = openai_requests.parse_chat(body, worker, {"tree_size": 8, "depth": 4})
    except openai_requests.APIError as error:
        assert 400 <= error.status < 500 and error.message and "\n" not in error.message
        assert set(error.body()["error"]) == {"message", "type", "param", "code"}
        return
    request, settings = call.request, call.request.settings
    assert settings.max_new_tokens >= 1 and 0 <= settings.temperature <= 2 and 0 < settings.top_p <= 1
    assert request.messages and request.messages[-1]["role"] == "user"
    assert all(isinstance(m["content"], str) for m in request.messages)
    assert all(0 < len(s) <= openai_requests.MAX_STOP_CHARS for s in call.stops)


@given(raw=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
@EXAMPLES
def test_any_raw_body_parses_to_an_object_or_a_400(raw):
    try:
        assert isinstance(openai_requests.parse_body(raw), dict)
    except openai_requests.APIError as error:
        assert error.status == 400


@dataclass
class Step:
    committed: list[int]


@EXAMPLES
@given(tokens=st.lists(st.lists(st.integers(0, 2000) | st.sampled_from([220, 271, 198, 11, 13]), min_size=1,
                                max_size=4), max_size=20),
       stops=st.lists(st.text(alphabet=" \n.,aeiostn", min_size=1, max_size=4), max_size=4))
def test_streamed_deltas_never_show_a_stop_string_and_add_up_to_the_answer(tokens, stops):
    tokenizer = support.tokenizer()
    answer = openai_api.Answer(tokenizer, stops)
    sent = ""
    for committed in tokens:
        if answer.stopped:
            break
        sent += answer.add(Step(committed))
    sent += answer.flush()
    assert sent == answer.text
    assert not any(stop in sent for stop in stops)
    full = tokenizer.decode([t for step in tokens for t in step], skip_special_tokens=True)
    assert full.startswith(sent)
    if not answer.stopped:
        assert sent == full
    else:  # cut exactly at the first stop string's first occurrence
        assert min(full.find(s) for s in stops if s in full) == len(sent)


@EXAMPLES
@given(data=st.binary(max_size=300) | json_values.map(lambda v: json.dumps(v).encode())
       | st.lists(st.fixed_dictionaries({"role": roles, "content": contents}), max_size=4).map(
           lambda m: json.dumps({"messages": m}).encode()))
def test_any_file_imports_as_a_conversation_or_a_one_line_error(data):
    try:
        system, history = import_conversation(data)
    except ValueError as error:
        assert str(error) and "\n" not in str(error)
        return
    assert isinstance(system, str)
    assert all(m["role"] in ("user", "assistant") and isinstance(m["content"], str) for m in history)
    again = import_conversation(export_conversation(system, history, None, None, None))
    assert again == (system, history)  # what imports, exports and imports the same
