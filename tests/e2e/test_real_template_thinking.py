"""The reasoning split under the real templates of the models that think (issue 56): a
model that answers with a fixed thinking and a fixed answer, under each template with
`<think>`, gives the thinking as `reasoning_content` and the answer as `content`, whole
and streamed, on chat completions; whether the generation prompt opens the block, closes
it (thinking off by default), or leaves it to the model."""

from __future__ import annotations

import openai
import pytest
from transformers import AutoTokenizer

from tests.live import serving
from tests.real_templates import REAL_TEMPLATES, build_template_model
from tests.tiny_model import build_agent_model

THINKING = sorted(file for file, real in REAL_TEMPLATES.items() if real.think)
ASK = [{"role": "user", "content": "x"}]


def expected(prompt: str) -> tuple[str, str | None, str]:
    """The reply the model is built to give after `prompt`, its reasoning and content."""
    end = prompt.rstrip()
    if end.endswith("<think>"):
        return "plan</think>OK", "plan", "OK"
    if end.endswith("</think>"):  # the template turned thinking off
        return "OK", None, "OK"
    return "<think>plan</think>OK", "plan", "OK"


@pytest.fixture(scope="module", params=THINKING)
def thinker(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("thinker")
    tokenizer_dir = build_template_model(root / "tokenizer", request.param)
    # As the server renders it: mlx-lm turns a thinking model's `enable_thinking` on.
    thinking = {"enable_thinking": True}
    prompt = AutoTokenizer.from_pretrained(str(tokenizer_dir)).apply_chat_template(
        ASK, tokenize=False, add_generation_prompt=True, **thinking
    )
    reply, reasoning, content = expected(prompt)
    path = build_agent_model(tokenizer_dir, root / "model", reply=reply, context=4096,
                             template_kwargs=thinking)  # fmt: skip
    with serving(str(path), served_model_name="tiny") as server:
        yield request.param, server, reasoning, content


def test_thinking_is_reasoning_and_the_answer_content_whole_and_streamed(thinker):
    file, server, reasoning, content = thinker
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    whole = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=32)
    message = whole.choices[0].message
    got = getattr(message, "reasoning_content", None) or None
    assert (got, message.content) == (reasoning, content), file
    stream = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=32, stream=True)
    thought, said = "", ""
    for chunk in stream:
        for choice in chunk.choices:
            thought += getattr(choice.delta, "reasoning_content", None) or ""
            said += choice.delta.content or ""
    assert (thought or None, said) == (reasoning, content), file
