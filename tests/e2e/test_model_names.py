"""A model name the server does not serve, as agents given only a base URL send their own
(`gpt-6.2-sol`, `openai/gpt-5.6-terra-pro`): with one model served, the default answers it on
every API, the reply naming what was asked for; off, it is the 404 it always was."""

from __future__ import annotations

import logging

import anthropic
import httpx
import openai
import pytest

from tests.live import serving

HELLO = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def one_model(tiny_model_dir):
    with serving(str(tiny_model_dir), served_model_name="tiny") as live:  # "auto": on
        yield live


def test_one_model_answers_any_name_on_every_api(one_model, caplog):
    url = one_model.url
    chat = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    name = "openai/gpt-5.6-terra-pro"
    with caplog.at_level(logging.INFO, logger="mlx_cache_server.models"):
        r = chat.chat.completions.create(model=name, messages=HELLO, max_tokens=2)
        assert r.model == name and r.usage.completion_tokens > 0
        chunks = list(
            chat.chat.completions.create(model=name, messages=HELLO, max_tokens=2, stream=True)
        )
        assert {c.model for c in chunks} == {name}
        done = chat.completions.create(model="gpt-3.5-turbo-instruct", prompt="a", max_tokens=2)
        assert done.model == "gpt-3.5-turbo-instruct"
        response = chat.responses.create(model="gpt-6.2-sol", input="hi", max_output_tokens=2)
        assert response.model == "gpt-6.2-sol" and response.usage.input_tokens > 0
        messages = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
        reply = messages.messages.create(model="gpt-6.2-sol", messages=HELLO, max_tokens=2)
        assert reply.model == "gpt-6.2-sol"
        count = messages.messages.count_tokens(model="gpt-6.2-sol", messages=HELLO)
        assert count.input_tokens > 0
    answered = [r.getMessage() for r in caplog.records if "not served here" in r.getMessage()]
    assert len(answered) == 3 and all("tiny" in line for line in answered)  # once per name
    # The real ids are what the server lists; an unknown id there is still unknown.
    assert [m.id for m in chat.models.list().data] == ["tiny"]
    assert httpx.get(url + "/v1/models/gpt-6.2-sol").status_code == 404


def test_with_the_setting_off_an_unknown_name_is_a_404_on_every_api(tiny_model_dir):
    with serving(str(tiny_model_dir), served_model_name="tiny", answer_any_model="off") as live:
        chat = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.NotFoundError) as e:
            chat.chat.completions.create(model="gpt-5", messages=HELLO, max_tokens=2)
        assert e.value.body["code"] == "model_not_found"
        with pytest.raises(openai.NotFoundError):
            chat.responses.create(model="gpt-5", input="hi", max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            chat.completions.create(model="gpt-5", prompt="a", max_tokens=2)
        messages = anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0)
        with pytest.raises(anthropic.NotFoundError):
            messages.messages.create(model="gpt-5", messages=HELLO, max_tokens=2)
        # Claude's names on /v1/messages are answered whatever the setting, as before.
        reply = messages.messages.create(model="claude-opus-4-7", messages=HELLO, max_tokens=2)
        assert reply.model == "claude-opus-4-7"
