"""Images through the chat completions API on a tiny Gemma 3 vision model: the same image
is served from the cache on later turns and in another conversation, a different one
never matches, greedy output with the cache equals output without it, and bad images
get a 400 that names their part."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import openai
import pytest
from PIL import Image

from tests.live import serving
from tests.vision_models import build_gemma3_vision


@pytest.fixture(scope="module")
def vision_dir(tmp_path_factory):
    return str(build_gemma3_vision(tmp_path_factory.mktemp("gemma3_vision")))


@pytest.fixture(scope="module")
def cached(vision_dir):
    with serving(vision_dir, speculation=False) as server:
        yield server


@pytest.fixture(scope="module")
def uncached(vision_dir):
    with serving(vision_dir, no_cache=True, speculation=False) as server:
        yield server


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def png(seed: int, size=(50, 40)) -> str:
    pixels = (np.random.RandomState(seed).rand(size[1], size[0], 3) * 255).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def ask(server, messages, max_tokens=8):
    r = client(server).chat.completions.create(
        model="m", messages=messages, max_tokens=max_tokens, temperature=0
    )
    return r.choices[0].message.content, r.usage


def conversation(server, first: list, follow_ups: list[str]):
    """Each turn's reply and usage: `first` as the user's content, then the follow-ups."""
    messages, out = [{"role": "user", "content": first}], []
    for follow_up in [None, *follow_ups]:
        if follow_up is not None:
            messages += [{"role": "user", "content": follow_up}]
        reply, usage = ask(server, messages)
        out.append((reply, usage))
        messages += [{"role": "assistant", "content": reply}]
    return out


# After the image in the first turn: "\n\n", "<end_of_image>", "\n\n", the text, the end of
# the turn and its newline, and the generation prompt "<start_of_turn>model\n".
AFTER_IMAGE = 2 + 1 + 2 + 2 + 7
# Before it: "<bos><start_of_turn>user\n", "\n\n<start_of_image>".
BEFORE_IMAGE = 7 + 3


def test_later_turns_reuse_the_image_and_replies_equal_uncached(cached, uncached):
    first = [image(png(1)), text("Describe.")]
    turns = conversation(cached, first, ["And the colours?", "Shorter."])
    plain = conversation(uncached, first, ["And the colours?", "Shorter."])
    assert [reply for reply, _ in turns] == [reply for reply, _ in plain]
    first_prompt = turns[0][1].prompt_tokens
    for _, usage in turns[1:]:  # the image's KV is reused, and everything before the reply
        assert usage.prompt_tokens_details.cached_tokens >= first_prompt - AFTER_IMAGE - 9


def test_the_same_image_in_another_conversation_is_reused_and_not_encoded(cached):
    encoded = cached.engine.vision.features.encoded
    url = png(2)
    ask(cached, [{"role": "user", "content": [image(url), text("What is this?")]}])
    assert cached.engine.vision.features.encoded == encoded + 1
    _, usage = ask(cached, [{"role": "user", "content": [image(url), text("Anything else?")]}])
    assert cached.engine.vision.features.encoded == encoded + 1
    assert usage.prompt_tokens_details.cached_tokens >= BEFORE_IMAGE + 4


def test_a_different_image_at_the_same_place_is_not_matched(cached):
    ask(cached, [{"role": "user", "content": [image(png(3)), text("Same text.")]}])
    _, usage = ask(cached, [{"role": "user", "content": [image(png(4)), text("Same text.")]}])
    assert usage.prompt_tokens_details.cached_tokens <= BEFORE_IMAGE


@pytest.mark.parametrize(
    "content",
    [
        [text("Look at this: "), image(png(5)), text(" and this: "), image(png(6)), text("?")],
        [text("A long preamble before the picture. " * 4), image(png(7))],
    ],
    ids=["two-images-in-the-middle", "image-last"],
)
def test_greedy_output_with_the_cache_equals_without(cached, uncached, content):
    follow_ups = ["Go on.", "Once more."]
    turns = conversation(cached, content, follow_ups)
    assert [r for r, _ in turns] == [r for r, _ in conversation(uncached, content, follow_ups)]
    assert turns[-1][1].prompt_tokens_details.cached_tokens > 0


def test_the_image_marker_as_text_is_not_an_image(cached, uncached):
    """A reply can generate the image marker's token, and a user can type it: sent back as
    text it stays the one token, while the image beside it is still placed (found by the
    browser test, where the 400 said 2 markers for 1 image)."""
    messages = [
        {"role": "user", "content": [image(png(14)), text("Describe <start_of_image> this.")]},
        {"role": "assistant", "content": "It is <start_of_image> noise."},
        {"role": "user", "content": "Again."},
    ]
    assert ask(cached, messages)[0] == ask(uncached, messages)[0]
    marked = [{"role": "user", "content": "Describe <start_of_image> this."}]
    plain = [{"role": "user", "content": "Describe X this."}]
    # The marker's text is its one token, not an image's positions.
    assert ask(cached, marked)[1].prompt_tokens == ask(cached, plain)[1].prompt_tokens


def test_text_alone_is_served_as_before(cached, uncached):
    messages = [{"role": "user", "content": "Hello there."}]
    assert ask(cached, messages)[0] == ask(uncached, messages)[0]


def bomb() -> str:
    """A PNG whose header claims 100000 x 100000 pixels."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0)
    raw = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0"))
    return "data:image/png;base64," + base64.b64encode(raw + chunk(b"IEND", b"")).decode()


def truncated() -> str:
    url = png(8, size=(300, 300))
    raw = base64.b64decode(url.split(",", 1)[1])
    return "data:image/png;base64," + base64.b64encode(raw[: len(raw) // 2]).decode()


BAD = {
    "not-an-image": "data:image/png;base64," + base64.b64encode(b"hello, world").decode(),
    "truncated": truncated(),
    "bomb": bomb(),
    "not-base64": "data:image/png;base64,@@@@",
    "a-web-url": "https://example.com/cat.png",
    "not-a-data-url": "data:text/plain,hello",
}


@pytest.mark.parametrize("url", BAD.values(), ids=BAD.keys())
def test_a_bad_image_is_a_400_naming_its_part(cached, url):
    content = [text("Look: "), image(url)]
    with pytest.raises(openai.BadRequestError) as e:
        ask(cached, [{"role": "user", "content": content}])
    assert e.value.body["param"] == "messages[0].content[1].image_url.url", e.value.body


def test_too_many_images_are_a_400(cached):
    content = [image(png(9))] * 17
    with pytest.raises(openai.BadRequestError, match="at most 16 images"):
        ask(cached, [{"role": "user", "content": content}])


def test_an_image_to_a_text_model_is_a_400_saying_so(tiny_model_dir):
    with serving(str(tiny_model_dir)) as server:
        with pytest.raises(openai.BadRequestError, match="does not take images") as e:
            ask(server, [{"role": "user", "content": [image(png(1)), text("Hi")]}])
    assert e.value.body["param"] == "messages[0].content[0]"


@pytest.fixture(scope="module")
def picture_site(tmp_path_factory):
    """A local web server holding a PNG (the pixels of `png(31)`) at /cat.png."""
    import http.server
    import threading

    folder = tmp_path_factory.mktemp("site")
    (folder / "cat.png").write_bytes(base64.b64decode(png(31).split(",", 1)[1]))

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(folder), **kwargs)

        def log_message(self, *args):
            pass

    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{site.server_address[1]}"
    site.shutdown()


def test_the_operators_limits_and_fetching_urls(vision_dir, picture_site):
    """`--fetch-image-urls` fetches an image a request names (the same pixels as a data URL
    are the same image to the cache), and the image limits are the operator's."""
    settings = {"fetch_image_urls": True, "max_images": 2, "max_image_pixels": 3000}
    with serving(vision_dir, speculation=False, **settings) as server:
        inline = [{"role": "user", "content": [image(png(31)), text("What is this?")]}]
        reply, usage = ask(server, inline)
        fetched = [{"role": "user", "content": [image(picture_site + "/cat.png"),
                                                text("What is this?")]}]  # fmt: skip
        again, usage_again = ask(server, fetched)
        assert again == reply
        assert usage_again.prompt_tokens_details.cached_tokens >= usage.prompt_tokens - 1
        for url, why in [(picture_site + "/gone.png", "could not be fetched"),
                         (png(32, size=(60, 60)), "at most 3000")]:  # fmt: skip
            with pytest.raises(openai.BadRequestError, match=why):
                ask(server, [{"role": "user", "content": [image(url)]}])
        with pytest.raises(openai.BadRequestError, match="at most 2 images"):
            ask(server, [{"role": "user", "content": [image(png(31))] * 3}])


def test_penalties_with_an_image_last_count_text_only(cached, uncached):
    """A penalty counts the prompt's tokens by id: an image's ids (past the vocabulary) are
    not text to it (they crashed the server when indexed)."""
    messages = [{"role": "user", "content": [text("Look:"), image(png(41))]}]

    def penalized(server):
        r = client(server).chat.completions.create(
            model="m", messages=messages, max_tokens=8, temperature=0,
            presence_penalty=1.0, frequency_penalty=0.5,
        )  # fmt: skip
        return r.choices[0].message.content

    assert penalized(cached) == penalized(uncached)


def test_a_request_holds_its_images_past_what_the_server_remembers(cached, uncached):
    """More images in flight than the server remembers: each stays until its request ends."""
    remembered = cached.engine.vision.ids.max_images
    cached.engine.vision.ids.max_images = 1
    try:
        content = [image(png(42)), image(png(43)), image(png(44)), text("Compare them.")]
        messages = [{"role": "user", "content": content}]
        assert ask(cached, messages)[0] == ask(uncached, messages)[0]
    finally:
        cached.engine.vision.ids.max_images = remembered


def test_the_placeholder_token_as_text_is_not_an_image(cached, uncached):
    messages = [
        {"role": "user", "content": [image(png(45)), text("What is <image_soft_token>?")]},
        {"role": "assistant", "content": "A <image_soft_token> token."},
        {"role": "user", "content": "Again."},
    ]
    assert ask(cached, messages)[0] == ask(uncached, messages)[0]


def test_an_image_in_a_format_not_taken_is_a_400(cached):
    out = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), dtype="uint8")).save(out, format="BMP")
    url = "data:image/bmp;base64," + base64.b64encode(out.getvalue()).decode()
    with pytest.raises(openai.BadRequestError, match="not an image this server can read"):
        ask(cached, [{"role": "user", "content": [image(url)]}])


def test_text_that_looks_like_a_data_url_is_counted_as_text(cached):
    huge = "data:image/png;base64," + "A" * 500_000
    with pytest.raises(openai.BadRequestError, match="context length"):
        ask(cached, [{"role": "user", "content": [text(huge)]}])


def test_drafts_over_an_image_prompt_reply_as_without(vision_dir, uncached, tmp_path):
    """Prompt lookup and a draft model see an image's positions as token 0 (a draft model's
    embedding would read out of bounds on their ids)."""
    draft = build_gemma3_vision(tmp_path / "draft", seed=1, sliding_window_pattern=1)
    messages = [{"role": "user", "content": [image(png(46)), text("Say it twice. " * 3)]}]
    with serving(vision_dir, draft_model=str(draft)) as drafting:
        assert ask(drafting, messages, 24)[0] == ask(uncached, messages, 24)[0]
