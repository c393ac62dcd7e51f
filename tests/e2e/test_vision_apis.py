"""Images through the Messages and Responses APIs on the tiny Gemma 3 and Qwen3-VL models, with
each SDK: image blocks and parts in user turns and in tool results, reused from the cache
on later turns, the same replies as without the cache, and bad images as 400s naming the
client's own field."""

from __future__ import annotations

import anthropic
import openai
import pytest

from mlx_cache_server.serving.images import ImageReader
from tests.e2e.test_vision import BEFORE_IMAGE, png
from tests.live import serving
from tests.vision_models import build_gemma3_vision, build_qwen3_vl_vision


@pytest.fixture(scope="module", params=["gemma3", "qwen3_vl"])
def servers(tmp_path_factory, request):
    build = {"gemma3": build_gemma3_vision, "qwen3_vl": build_qwen3_vl_vision}[request.param]
    folder = str(build(tmp_path_factory.mktemp(request.param)))
    with serving(folder, speculation=False) as cached:
        with serving(folder, no_cache=True, speculation=False) as uncached:
            yield cached, uncached


def b64(url: str) -> str:
    return url.split(",", 1)[1]


def image_block(seed: int) -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                        "data": b64(png(seed))}}  # fmt: skip


def messages_turns(server, turns: list[list]) -> list:
    """Each turn's reply and usage through the Messages API, the replies kept."""
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    history, out = [], []
    for content in turns:
        history.append({"role": "user", "content": content})
        r = client.messages.create(
            model="m", max_tokens=8, messages=history, extra_body={"temperature": 0}
        )
        reply = "".join(b.text for b in r.content if b.type == "text")
        out.append((reply, r.usage))
        history.append({"role": "assistant", "content": reply or "."})
    return out


def test_messages_image_blocks_are_reused_and_reply_as_uncached(servers):
    cached, uncached = servers
    turns = [[image_block(21), {"type": "text", "text": "Describe."}],
             [{"type": "text", "text": "More."}], [{"type": "text", "text": "Less."}]]  # fmt: skip
    encoded = cached.engine.vision.features.encoded
    got = messages_turns(cached, turns)
    assert cached.engine.vision.features.encoded == encoded + 1  # the image, once
    assert [r for r, _ in got] == [r for r, _ in messages_turns(uncached, turns)]
    for _, usage in got[1:]:
        assert usage.cache_read_input_tokens > BEFORE_IMAGE + 4


def test_an_image_in_a_tool_result_is_an_image(servers):
    cached, uncached = servers
    call = {"type": "tool_use", "id": "toolu_1", "name": "screenshot", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1",
              "content": [{"type": "text", "text": "Here:"}, image_block(22)]}  # fmt: skip
    history = [
        {"role": "user", "content": "Take a screenshot."},
        {"role": "assistant", "content": [call]},
        {"role": "user", "content": [result]},
    ]
    tools = [
        {"name": "screenshot", "description": "Screenshot", "input_schema": {"type": "object"}}
    ]

    def ask(server, extra=()):
        client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
        messages = [*history, *extra]
        return client.messages.create(
            model="m", max_tokens=8, tools=tools, messages=messages, extra_body={"temperature": 0}
        )

    first = ask(cached)
    assert first.content == ask(uncached).content
    assert cached.engine.vision.features.encoded >= 1
    # The same result with another image is another prompt from the image on.
    other = dict(result, content=[{"type": "text", "text": "Here:"}, image_block(23)])
    history[-1] = {"role": "user", "content": [other]}
    assert ask(cached).usage.cache_read_input_tokens < first.usage.input_tokens


def test_a_bad_image_block_is_a_400_naming_its_field(servers):
    client = anthropic.Anthropic(base_url=servers[0].url, api_key="x", max_retries=0)
    bad = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                       "data": "aGVsbG8="}}  # fmt: skip
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="m", max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, bad]}])  # fmt: skip
    assert "messages[0].content[1].source.data" in str(e.value)
    url = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    with pytest.raises(anthropic.BadRequestError, match="base64"):
        client.messages.create(model="m", max_tokens=4,
                               messages=[{"role": "user", "content": [url]}])  # fmt: skip


def test_an_image_in_the_system_prompt_is_a_400(servers):
    """Anthropic's system prompt takes text blocks only: an image there is refused, not
    turned into a line of text."""
    client = anthropic.Anthropic(base_url=servers[0].url, api_key="x", max_retries=0)
    system = [{"type": "text", "text": "Be brief."}, image_block(26)]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="m", max_tokens=4, system=system,  # type: ignore[arg-type]
                               messages=[{"role": "user", "content": "Hi"}])  # fmt: skip
    assert "system[1]" in str(e.value)


def test_a_translated_image_is_decoded_once(servers, monkeypatch):
    """Messages and Responses check each image in their translation (so a bad one's 400
    names the client's field); the render takes the opened image from there."""
    cached, _ = servers
    opened = []
    real = ImageReader._opened

    def counted(self, raw, param):
        opened.append(param)
        return real(self, raw, param)

    monkeypatch.setattr(ImageReader, "_opened", counted)
    messages_turns(cached, [[image_block(27), {"type": "text", "text": "Describe."}]])
    assert opened == ["messages[0].content[0].source.data"]
    opened.clear()
    client = openai.OpenAI(base_url=cached.url + "/v1", api_key="x", max_retries=0)
    part = {"type": "input_image", "image_url": png(27)}
    client.responses.create(model="m", input=[{"role": "user", "content": [part]}],
                            max_output_tokens=4, temperature=0)  # fmt: skip
    assert opened == ["input[0][0].image_url"]
    opened.clear()
    counting = anthropic.Anthropic(base_url=cached.url, api_key="x", max_retries=0)
    turn = {"role": "user", "content": [image_block(27)]}
    counting.messages.count_tokens(model="m", messages=[turn])  # type: ignore[list-item]
    assert opened == ["messages[0].content[0].source.data"]


def responses_turns(server, first: list) -> list:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    history, out = [{"role": "user", "content": first}], []
    for follow_up in [None, "More.", "Less."]:
        if follow_up is not None:
            history.append({"role": "user", "content": follow_up})
        r = client.responses.create(model="m", input=history, max_output_tokens=8, temperature=0)
        out.append((r.output_text, r.usage))
        history.append({"role": "assistant", "content": r.output_text or "."})
    return out


def test_responses_input_images_are_reused_and_reply_as_uncached(servers):
    cached, uncached = servers
    first = [{"type": "input_image", "image_url": png(24)},
             {"type": "input_text", "text": "Describe."}]  # fmt: skip
    got = responses_turns(cached, first)
    assert [r for r, _ in got] == [r for r, _ in responses_turns(uncached, first)]
    for _, usage in got[1:]:
        assert usage.input_tokens_details.cached_tokens > BEFORE_IMAGE + 4


def test_an_image_in_a_function_call_output_is_an_image(servers):
    cached, uncached = servers
    items = [
        {"role": "user", "content": "Take a screenshot."},
        {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1",
         "output": [{"type": "input_image", "image_url": png(25)}]},
    ]  # fmt: skip
    tools = [{"type": "function", "name": "shot", "parameters": {"type": "object"}}]

    def ask(server):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        return client.responses.create(model="m", input=items, tools=tools,
                                       max_output_tokens=8, temperature=0)  # fmt: skip

    encoded = cached.engine.vision.features.encoded
    assert ask(cached).output_text == ask(uncached).output_text
    assert cached.engine.vision.features.encoded == encoded + 1


def test_a_bad_input_image_is_a_400_naming_its_part(servers):
    client = openai.OpenAI(base_url=servers[0].url + "/v1", api_key="x", max_retries=0)
    bad = [{"type": "input_image", "image_url": "data:image/png;base64,aGVsbG8="}]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="m", input=[{"role": "user", "content": bad}])
    assert e.value.body["param"] == "input[0][0].image_url"
