"""Images on tiny Qwen-VL and Qwen3.5 models, whose image positions form a grid
(M-RoPE) and move the text after them (and Qwen3-VL's first layers add the encoder's
deepstack): the reply is mlx-vlm's own for the same prompt, later turns reuse the
image, greedy output with the cache equals output without it whether the image is first,
in the middle or in a tool result, whether prompts are prefilled in chunks that cut the
image, together in one batch, or with quantized KV, and a different image never matches.
"""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import pytest
from PIL import Image

pytest.importorskip("mlx_vlm")

from tests.e2e.test_vision import ask, conversation, image, png, text  # noqa: E402
from tests.live import serving  # noqa: E402
from tests.vision_models import build_qwen_vl_vision  # noqa: E402

# Before an image's first position: "<|im_start|>user\n" and "<|vision_start|>".
BEFORE_IMAGE = 1 + 5 + 1 + 1


@pytest.fixture(
    scope="module",
    params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"],
)
def qwen_dir(tmp_path_factory, request):
    return str(build_qwen_vl_vision(tmp_path_factory.mktemp(request.param), request.param))


@pytest.fixture(scope="module")
def cached(qwen_dir):
    # Chunks of 16 tokens: the prefill cuts a 24-position image, and its turns' prompts.
    with serving(qwen_dir, speculation=False, prefill_step_size=16) as server:
        yield server


@pytest.fixture(scope="module")
def uncached(qwen_dir):
    with serving(qwen_dir, no_cache=True, speculation=False) as server:
        yield server


def decoded(url: str) -> Image.Image:
    import base64

    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")


def test_the_reply_is_mlx_vlms_own(qwen_dir, cached):
    from mlx_vlm import generate
    from mlx_vlm.utils import load_model, load_processor

    url = png(31, size=(32, 48))
    content = [text("Look: "), image(url), text(" What is it?")]
    reply, usage = ask(cached, [{"role": "user", "content": content}], max_tokens=10)
    vlm, processor = load_model(Path(qwen_dir)), load_processor(Path(qwen_dir))
    parts = [{"type": "text", "text": "Look: "}, {"type": "image"},
             {"type": "text", "text": " What is it?"}]  # fmt: skip
    prompt = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
    )
    expected = generate(vlm, processor, prompt, image=[decoded(url)], max_tokens=10, temperature=0)
    assert usage.prompt_tokens == expected.prompt_tokens
    assert reply == expected.text.removesuffix("<|im_end|>")


def test_later_turns_reuse_the_image_and_reply_as_uncached(cached, uncached):
    first = [image(png(32, size=(48, 32))), text("Describe.")]
    follow_ups = ["And the colours?", "Shorter."]
    turns = conversation(cached, first, follow_ups)
    assert [r for r, _ in turns] == [r for r, _ in conversation(uncached, first, follow_ups)]
    first_prompt = turns[0][1].prompt_tokens
    for _, usage in turns[1:]:
        assert usage.prompt_tokens_details.cached_tokens >= first_prompt - 1


@pytest.mark.parametrize(
    "content",
    [
        [image(png(33)), text("What is this?")],
        [text("Look at this: "), image(png(34, size=(24, 56))), text(" and this: "),
         image(png(35)), text("?")],
    ],
    ids=["image-first", "two-images-in-the-middle"],
)  # fmt: skip
def test_greedy_output_with_the_cache_equals_without(cached, uncached, content):
    follow_ups = ["Go on.", "Once more."]
    turns = conversation(cached, content, follow_ups)
    assert [r for r, _ in turns] == [r for r, _ in conversation(uncached, content, follow_ups)]
    assert turns[-1][1].prompt_tokens_details.cached_tokens > turns[0][1].prompt_tokens - 2


def test_a_different_image_at_the_same_place_is_not_matched(cached):
    ask(cached, [{"role": "user", "content": [image(png(36)), text("Same text.")]}])
    _, usage = ask(cached, [{"role": "user", "content": [image(png(37)), text("Same text.")]}])
    assert usage.prompt_tokens_details.cached_tokens <= BEFORE_IMAGE


def test_prompts_with_different_images_batched_together_reply_as_alone(cached, uncached):
    """Prefilled in one batch and decoded together, each row at its own positions."""
    asks = [
        [{"role": "user", "content": [image(png(40 + i, size=(32 + 8 * i, 40))), text("Hm?")]}]
        for i in range(4)
    ]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda m: ask(cached, m, 12)[0], asks))
    assert together == [ask(uncached, m, 12)[0] for m in asks]


def test_an_image_in_a_tool_result_replies_as_uncached(cached, uncached):
    data = png(44).split(",", 1)[1]
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": data}}  # fmt: skip
    call = {"type": "tool_use", "id": "t1", "name": "screenshot", "input": {}}
    history = [
        {"role": "user", "content": "Take a screenshot."},
        {"role": "assistant", "content": [call]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [block]}]},
    ]  # fmt: skip
    tools = [{"name": "screenshot", "input_schema": {"type": "object"}}]

    def reply(server) -> tuple[str, int]:
        client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
        r = client.messages.create(model="m", max_tokens=8, messages=history, tools=tools,
                                   extra_body={"temperature": 0})  # fmt: skip
        return "".join(b.text for b in r.content if b.type == "text"), r.usage

    first, _ = reply(cached)
    again, usage = reply(cached)
    assert first == again == reply(uncached)[0]
    assert usage.cache_read_input_tokens >= usage.input_tokens + usage.cache_read_input_tokens - 2


def test_quantized_kv_with_the_cache_replies_as_without(tmp_path):
    folder = str(build_qwen_vl_vision(tmp_path / "q", "qwen3_vl", hidden=128))  # heads of 32
    messages = [{"role": "user", "content": [text("See "), image(png(45)), text(" now.")]}]
    quantized = {"kv_bits": 8, "kv_group_size": 32, "speculation": False}
    with serving(folder, **quantized) as server:
        first = ask(server, messages, 10)[0]
        again, usage = ask(server, messages, 10)
        assert usage.prompt_tokens_details.cached_tokens > BEFORE_IMAGE
    with serving(folder, no_cache=True, **quantized) as server:
        assert first == again == ask(server, messages, 10)[0]


def test_drafts_over_an_image_prompt_reply_as_without(qwen_dir, uncached):
    messages = [{"role": "user", "content": [image(png(46)), text("Say it twice. " * 3)]}]
    with serving(qwen_dir) as drafting:  # prompt lookup on
        assert ask(drafting, messages, 24)[0] == ask(uncached, messages, 24)[0]


def test_a_restarted_server_continues_from_the_disk_tier(qwen_dir, uncached, tmp_path):
    """After a restart the image's ids come back from the disk tier's record, and its grid
    from the request that sends it again: the text after it stands where it stood."""
    kv = str(tmp_path / "kv")
    first = [{"role": "user", "content": [text("See "), image(png(47)), text(" here.")]}]
    with serving(qwen_dir, cache_dir=kv, speculation=False) as server:
        if server.engine.cache_mode != "prefix":
            pytest.skip("the disk tier keeps attention-only models' caches (Qwen3.5 is hybrid)")
        reply, usage = ask(server, first)
    later = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "More."}]
    with serving(qwen_dir, cache_dir=kv, speculation=False) as server:
        again, usage_again = ask(server, later)
        assert usage_again.prompt_tokens_details.cached_tokens >= usage.prompt_tokens - 1
    assert again == ask(uncached, later)[0]
