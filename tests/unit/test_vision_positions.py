"""Our image path against mlx-vlm's own models of the same checkpoints. For the Qwen-VL and
Qwen3.5 models (M-RoPE, `models.vision_positions`; from Qwen3-VL on its frequencies
interleaved, and Qwen3-VL's deepstack): the offsets worked out from the tokens by hand,
and the language model as mlx-lm loads it, given those positions, against mlx-vlm's: the
same logits for a prompt with two images run whole or in chunks that cut the images, and
for the tokens decoded after it. For Gemma 3: the same logits."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mlx_vlm")

import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from PIL import Image as PILImage  # noqa: E402

from mlx_cache_server.models.vision import (  # noqa: E402
    IMAGE_BASE,
    Deepstack,
    DeepstackLayer,
    Holds,
    ImageIds,
    Passes,
)
from mlx_cache_server.models.vision_load import IMAGE, open_vision  # noqa: E402
from mlx_cache_server.models.vision_positions import ImagePositions, frequency_axes  # noqa: E402
from tests.vision_models import build_gemma3_vision, build_qwen_vl_vision  # noqa: E402

# Logits agree to this: Qwen3.5's Gated DeltaNet layers are mlx-lm's and mlx-vlm's own
# code, which round differently; a wrong position or a missing deepstack is off by units.
ATOL = 1e-2


def registered(count: int, grid: tuple[int, int, int] | None, seed: int, ids: ImageIds):
    return ids.register(np.full((1, 2), seed, dtype=np.float32), count, grid=grid)


def test_offsets_by_hand():
    ids = ImageIds()
    image = registered(6, (1, 2, 3), 1, ids)  # 2 rows of 3: its span is 3, its count 6
    positions = ImagePositions(ids, Passes())
    a, b = image.first, image.first + 5
    tokens = [7, 8, *range(a, b + 1), 9, 10]
    table = positions.offsets_of([], tokens)
    # Text before: its index. Position k of the image at (s, s + k // 3, s + k % 3), s = 2
    # its start, so its offset is (0, k // 3, k % 3) - k. Text after: s + 3 = index - 3.
    expected = [[0, 0, 0], [0, 0, 0]]
    expected += [[-k, k // 3 - k, k % 3 - k] for k in range(6)]
    expected += [[-3, -3, -3], [-3, -3, -3]]
    assert table.tolist() == expected
    assert positions.shift(tokens) == -3
    # Cut anywhere, each piece after what is before it gives the same offsets.
    for cut in range(len(tokens) + 1):
        pieces = [positions.offsets_of(tokens[:cut], tokens[cut:]), table[cut:]]
        assert pieces[0].tolist() == pieces[1].tolist()


def test_a_shift_counts_each_whole_image_each_time_and_not_one_cut_short():
    ids = ImageIds()
    image = registered(4, (1, 2, 2), 2, ids)  # span 2, count 4: each moves text by -2
    plain = registered(3, None, 3, ids)  # a run of plain positions moves nothing
    positions = ImagePositions(ids, Passes())
    run = list(range(image.first, image.first + 4))
    assert positions.shift([1, *run, 2, *run, 3]) == -4
    assert positions.shift([1, *run, 2, *run[:3]]) == -2
    assert positions.shift([*range(plain.first, plain.first + 3), *run]) == -2
    assert positions.shift([1, 2, 3]) == 0
    assert ImagePositions(ImageIds(), Passes()).shift([1, IMAGE_BASE - 1]) == 0


def test_a_pass_without_images_sets_one_shift_a_row_and_none_for_text():
    ids = ImageIds()
    image = registered(4, (1, 2, 2), 4, ids)
    positions = ImagePositions(ids, Passes())
    run = list(range(image.first, image.first + 4))
    with positions.prefilling([([1, *run], [5, 6]), ([1, 2], [3])]):
        assert positions.offsets.tolist() == [-2, 0]
    assert positions.offsets is None
    with positions.prefilling([([1], [2, 3])]):
        assert positions.offsets is None
    with positions.decoding([0, -2]):
        assert positions.offsets.tolist() == [0, -2]


def test_frequencies_in_sections_or_interleaved():
    assert frequency_axes([2, 3, 3], 8, False).tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    # Qwen3-VL: height and width every third frequency from the second and third on.
    assert frequency_axes([2, 3, 3], 8, True).tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    assert frequency_axes([4, 2, 2], 8, True).tolist() == [0, 1, 2, 0, 1, 2, 0, 0]
    with pytest.raises(ValueError, match="do not cover"):
        frequency_axes([2, 3, 2], 8, False)


@pytest.fixture(
    scope="module",
    params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"],
)
def qwen(tmp_path_factory, request):
    from mlx_vlm.utils import load_model, load_processor

    folder = build_qwen_vl_vision(tmp_path_factory.mktemp(request.param), request.param)
    model, tokenizer = load(str(folder))
    vision, why = open_vision(folder, model)
    assert vision is not None, why
    return model, tokenizer, vision, load_model(folder), load_processor(folder)


def picture(seed: int, size: tuple[int, int]) -> PILImage.Image:
    rgb = np.random.RandomState(seed).rand(size[1], size[0], 3) * 255
    return PILImage.fromarray(rgb.astype("uint8"))


def prompt(qwen):
    """Our tokens and mlx-vlm's logits for a prompt with two images of different shapes."""
    model, tokenizer, vision, vlm, processor = qwen
    images = [picture(1, (32, 48)), picture(2, (40, 24))]
    content = [{"type": "text", "text": "hi "}, {"type": "image"},
               {"type": "text", "text": " and "}, {"type": "image"},
               {"type": "text", "text": " what?"}]  # fmt: skip
    messages = [{"role": "user", "content": content}]
    text = processor.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    given = processor(text=[text], images=images, return_tensors="np")
    out = vlm(
        mx.array(given["input_ids"]),
        mx.array(given["pixel_values"]),
        image_grid_thw=mx.array(given["image_grid_thw"]),
    )
    marked = text.replace("<|vision_start|>", IMAGE + "<|vision_start|>")
    tokens = vision.tokens(marked, vision.prepare(images), Holds(vision.ids))
    assert len(tokens) == given["input_ids"].shape[1]
    return tokens, out.logits, (text, images)


def test_logits_equal_mlx_vlms_whole_and_in_chunks_that_cut_the_images(qwen):
    model, _, vision, _, _ = qwen
    tokens, expected, _ = prompt(qwen)
    positions = vision.positions
    assert positions.shift(tokens) < 0  # the images move what follows them
    with positions.prefilling([([], tokens)]):
        whole = model(mx.array([tokens]))
    assert mx.allclose(whole, expected, atol=ATOL).item()
    # The positions are what matter: the same pass at plain positions is another result.
    assert not mx.allclose(model(mx.array([tokens])), expected, atol=1e-1).item()
    deepened = [layer for layer in model.layers if isinstance(layer, DeepstackLayer)]
    assert len(deepened) == (2 if model.model_type.startswith("qwen3_vl") else 0)
    for layer in deepened:  # and so is the deepstack, where the model has one
        kept, layer._deepstack = layer._deepstack, Deepstack()
        with positions.prefilling([([], tokens)]):
            assert not mx.allclose(model(mx.array([tokens])), expected, atol=1e-1).item()
        layer._deepstack = kept
    for size in (5, 7, 16):
        cache = make_prompt_cache(model)
        for at in range(0, len(tokens), size):
            with positions.prefilling([(tokens[:at], tokens[at : at + size])]):
                last = model(mx.array([tokens[at : at + size]]), cache=cache)[0, -1]
        assert mx.allclose(last, expected[0, -1], atol=ATOL).item(), size


def test_decoding_after_the_images_gives_mlx_vlms_logits(qwen):
    """Each decoded token's logits, at the positions its stream's shift gives, equal
    mlx-vlm's for the prompt and the tokens decoded so far run as one prompt."""
    model, _, vision, vlm, processor = qwen
    tokens, _, (text, images) = prompt(qwen)
    positions = vision.positions
    cache = make_prompt_cache(model)
    with positions.prefilling([([], tokens)]):
        steps = [model(mx.array([tokens]), cache=cache)[0, -1]]
    shift, out = positions.shift(tokens), []
    for _ in range(7):
        out.append(int(mx.argmax(steps[-1]).item()))
        with positions.decoding([shift]):
            steps.append(model(mx.array([[out[-1]]]), cache=cache)[0, -1])
    given = processor(text=[text], images=images, return_tensors="np")
    ids = mx.concatenate([mx.array(given["input_ids"]), mx.array([out])], axis=1)
    grid = mx.array(given["image_grid_thw"])
    expected = vlm(ids, mx.array(given["pixel_values"]), image_grid_thw=grid).logits
    assert mx.allclose(mx.stack(steps), expected[0, len(tokens) - 1 :], atol=ATOL).item()


def test_gemma3_logits_equal_mlx_vlms(tmp_path):
    from mlx_vlm.utils import load_model, load_processor

    folder = build_gemma3_vision(tmp_path / "gemma3", tied=True)
    model, _ = load(str(folder))
    vision, why = open_vision(folder, model)
    assert vision is not None, why
    vlm, processor = load_model(folder), load_processor(folder)
    content = [{"type": "text", "text": "Look: "}, {"type": "image"},
               {"type": "text", "text": " What is it?"}]  # fmt: skip
    text = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    images = [picture(3, (50, 40))]
    given = processor(text=[text], images=images, return_tensors="np")
    ids = mx.array(given["input_ids"])
    embedded = vlm.get_input_embeddings(
        ids, mx.array(given["pixel_values"]), mask=mx.ones(ids.shape)
    )
    expected = vlm.language_model(ids, inputs_embeds=embedded.inputs_embeds).logits
    marked = text.replace("<start_of_image>", IMAGE + "<start_of_image>")
    tokens = vision.tokens(marked, vision.prepare(images), Holds(vision.ids))
    assert mx.allclose(model(mx.array([tokens])), expected, atol=1e-3).item()


def test_a_forgotten_images_place_is_still_known_while_a_sequence_runs():
    """A request's hold ends a step before the engine drops its sequence: its images may
    be forgotten by then, and the sequence's next pass still needs where they stand."""
    ids = ImageIds(max_images=1)
    first = registered(4, (1, 2, 2), 5, ids)
    registered(4, (1, 2, 2), 6, ids)
    ids.release([first])  # past max_images: forgotten
    run = list(range(first.first, first.first + 4))
    assert ids.of(first.first) is None
    positions = ImagePositions(ids, Passes())
    assert positions.shift([1, *run, 2]) == -2
    with positions.prefilling([([1, *run], [2, 3])]):
        assert positions.offsets.tolist() == [-2]


def test_a_prompt_pass_one_token_wide_embeds_its_image(qwen):
    """A chunk of one token is a prompt's pass too (a busy batch cuts prompts that small):
    its image positions get the image's features, not the text embedding a decode step's
    sampled token gets."""
    model, _, vision, _, _ = qwen
    tokens, expected, _ = prompt(qwen)
    cache = make_prompt_cache(model)
    for at in range(len(tokens)):
        with vision.positions.prefilling([(tokens[:at], tokens[at : at + 1])]):
            last = model(mx.array([tokens[at : at + 1]]), cache=cache)[0, -1]
    assert mx.allclose(last, expected[0, -1], atol=ATOL).item()
