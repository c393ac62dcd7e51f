"""A tiny random-weight vision model of the Gemma 3 family, built from mlx-vlm's model
classes with a processor configured locally (no model hub).

Its language model is mlx-lm's `gemma3` (2 layers, hidden size 64) and its vision tower a
1-layer SigLIP on 32x32 images cut in 8x8 patches, pooled to 4 positions per image. The
vocabulary is the tiny llama's (printable ASCII, one token per character) and Gemma's
turn and image markers; the chat template writes `<start_of_image>` for an image part,
which the processor expands to the image's positions as Gemma 3's does.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from .tiny_model import build_tokenizer

SPECIAL = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>",
           "<start_of_image>", "<end_of_image>", "<image_soft_token>"]  # fmt: skip
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<start_of_image>{% elif p['type'] == 'text' %}"
    "{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
IMAGE_SIZE = 32


def build_gemma3_vision(
    path: Path,
    seed: int = 0,
    sliding_window_pattern: int = 2,
    image_size: int = IMAGE_SIZE,
    patch_size: int = 8,
    positions: int = 4,
    hidden: int = 64,
    layers: int = 2,
    tied: bool = False,
) -> Path:
    """Write the model folder to `path` (created) and return it. The sizes default to the
    tests' tiny model; a benchmark asks for a larger one (`positions` per image, a square)."""
    from mlx_vlm.models import gemma3

    path.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    tokenizer = build_tokenizer(SPECIAL)
    tokenizer.save(str(path / "tokenizer.json"))
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL}
    vocab = tokenizer.get_vocab_size()
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>",
        "eos_token": "<end_of_turn>", "pad_token": "<pad>", "unk_token": "<unk>",
        "chat_template": TEMPLATE, "model_max_length": 8192,
        "extra_special_tokens": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                 "image_token": "<image_soft_token>"},
    }))  # fmt: skip
    text = {
        "model_type": "gemma3_text", "hidden_size": hidden, "num_hidden_layers": layers,
        "intermediate_size": 2 * hidden, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": hidden // 4, "vocab_size": vocab, "query_pre_attn_scalar": hidden // 4,
        "sliding_window": 64, "sliding_window_pattern": sliding_window_pattern,
        "mm_tokens_per_image": positions, "max_position_embeddings": 8192,
    }  # fmt: skip
    vision = {
        "model_type": "siglip_vision_model", "num_hidden_layers": layers // 2 or 1,
        "hidden_size": hidden // 2, "intermediate_size": hidden, "num_attention_heads": 2,
        "patch_size": patch_size, "image_size": image_size,
    }  # fmt: skip
    config = {
        "model_type": "gemma3", "text_config": text, "vision_config": vision,
        "vocab_size": vocab, "image_token_index": ids["<image_soft_token>"],
        "boi_token_index": ids["<start_of_image>"], "eoi_token_index": ids["<end_of_image>"],
        "hidden_size": hidden, "pad_token_id": ids["<pad>"],
        "eos_token_id": [ids["<end_of_turn>"]], "mm_tokens_per_image": positions,
    }  # fmt: skip
    model_config = gemma3.ModelConfig.from_dict(config)
    model_config.text_config = gemma3.TextConfig.from_dict(text)
    model_config.vision_config = gemma3.VisionConfig.from_dict(vision)
    model = gemma3.Model(model_config)
    # Larger than default init so logits are far from ties and outputs vary. An output head
    # of its own, unlike Gemma 3's checkpoints (`tied`): a tiny random model whose head is
    # its embedding repeats its last token. mlx-lm reads the head; mlx-vlm 0.7 ties it all
    # the same, so a test comparing the two asks for `tied`.
    weights = {k: v * 4 if v.ndim == 2 else v for k, v in tree_flatten(model.parameters())
               if not (tied and k == "language_model.lm_head.weight")}  # fmt: skip
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(config))
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Gemma3ImageProcessor",
        "size": {"height": image_size, "width": image_size}, "do_resize": True,
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 2,
        "do_convert_rgb": True, "processor_class": "Gemma3Processor",
    }))  # fmt: skip
    (path / "processor_config.json").write_text(
        json.dumps({"processor_class": "Gemma3Processor", "image_seq_length": positions})
    )
    return path


QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]  # fmt: skip
QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_qwen2_5_vl_vision(path: Path, seed: int = 0, hidden: int = 64) -> Path:
    """A tiny random Qwen2.5-VL (`build_qwen_vl_vision`)."""
    return build_qwen_vl_vision(path, "qwen2_5_vl", seed=seed, hidden=hidden)


def build_qwen3_vl_vision(path: Path, seed: int = 0, hidden: int = 64) -> Path:
    """A tiny random Qwen3-VL (`build_qwen_vl_vision`)."""
    return build_qwen_vl_vision(path, "qwen3_vl", seed=seed, hidden=hidden)


def build_qwen_vl_vision(
    path: Path,
    family: str,
    seed: int = 0,
    patch_size: int = 4,
    hidden: int = 64,
    max_pixels: int = 64 * 64,
) -> Path:
    """A tiny random Qwen vision model of `family` ("qwen2_vl", "qwen2_5_vl", "qwen3_vl",
    "qwen3_vl_moe", "qwen3_5" or "qwen3_5_moe"): mlx-lm's language model of it (2 layers;
    Qwen3.5's 4, Gated DeltaNet and full attention in turn) with M-RoPE positions (a
    quarter of each head's rotary frequencies for time, the rest for height and width in
    halves; one section after another, or interleaved from Qwen3-VL on) and a 2-block
    vision tower on images cut in `patch_size` patches, 2x2 patches merged into one
    position, so an image of 32x48 pixels takes 4x6 positions; Qwen3-VL's tower also gives
    a deepstack level from each block, added to the output of the first two layers. Its
    processor resizes an image to a multiple of 8 pixels a side (2 patches), between 16x16
    and 64x64 pixels in all (`max_pixels`). A benchmark asks for a larger one."""
    from mlx_vlm.models import qwen2_5_vl, qwen2_vl, qwen3_5, qwen3_5_moe, qwen3_vl, qwen3_vl_moe

    path.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    tokenizer = build_tokenizer(QWEN_SPECIAL)
    tokenizer.save(str(path / "tokenizer.json"))
    ids = {t: tokenizer.token_to_id(t) for t in QWEN_SPECIAL}
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": "<unk>",
        "chat_template": QWEN_TEMPLATE, "model_max_length": 8192,
    }))  # fmt: skip
    heads = 4
    half = hidden // heads // 2  # each head's rotary frequencies
    t, h = half // 4, (half - half // 4) // 2
    qwen3 = family.startswith("qwen3")
    text = {
        "model_type": {"qwen3_vl": "qwen3", "qwen3_vl_moe": "qwen3_moe"}.get(family, "qwen2"),
        "hidden_size": hidden,
        "num_hidden_layers": 2, "intermediate_size": 2 * hidden, "num_attention_heads": heads,
        "num_key_value_heads": 2, "head_dim": hidden // heads, "rms_norm_eps": 1e-6,
        "vocab_size": tokenizer.get_vocab_size(), "rope_theta": 1000000.0,
        "max_position_embeddings": 8192, "tie_word_embeddings": not qwen3,
        "rope_scaling": {"type": "mrope", "mrope_section": [t, h, half - t - h],
                         **({"mrope_interleaved": True} if qwen3 else {})},
    }  # fmt: skip
    vision = {
        "model_type": family, "depth": 2, "hidden_size": 32, "intermediate_size": 64,
        "out_hidden_size": hidden, "num_heads": 2, "patch_size": patch_size,
        "spatial_patch_size": patch_size, "spatial_merge_size": 2, "temporal_patch_size": 2,
        "window_size": 4 * patch_size, "fullatt_block_indexes": [1], "in_channels": 3,
        **({"num_position_embeddings": 64, "deepstack_visual_indexes": [0, 1]} if qwen3 else {}),
        **({"deepstack_visual_indexes": []} if family.startswith("qwen3_5") else {}),
    }  # fmt: skip
    if family.startswith("qwen3_5"):  # Gated DeltaNet layers, every other one full attention
        text.update({
            "model_type": family + "_text", "full_attention_interval": 2,
            "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
            "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "num_hidden_layers": 4,
            "head_dim": 2 * hidden // heads,  # half of it rotated: the same frequencies
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                "partial_rotary_factor": 0.5, **text.pop("rope_scaling")},
        })  # fmt: skip
    if family.endswith("_moe"):  # 4 experts of 32, 2 a token, in every layer
        text.update({"num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
                     "mlp_only_layers": [], "moe_intermediate_size": 32,
                     "shared_expert_intermediate_size": 64, "norm_topk_prob": True})  # fmt: skip
    if family == "qwen2_vl":  # its tower is sized by other names
        vision.update({"embed_dim": 32, "hidden_size": hidden, "mlp_ratio": 2})
    tokens = {
        "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"], "vision_token_id": ids["<|vision_pad|>"],
        "eos_token_id": [ids["<|im_end|>"]], "bos_token_id": None,
    }  # fmt: skip
    # Qwen2.5-VL's checkpoints give the text model's settings at the top; Qwen3-VL's nest them.
    config = {"model_type": family, "vision_config": vision, **tokens}
    config.update({"text_config": text} if qwen3 else text)
    config["model_type"] = family
    module = {"qwen2_vl": qwen2_vl, "qwen2_5_vl": qwen2_5_vl, "qwen3_vl": qwen3_vl,
              "qwen3_vl_moe": qwen3_vl_moe, "qwen3_5": qwen3_5,
              "qwen3_5_moe": qwen3_5_moe}[family]  # fmt: skip
    model_config = module.ModelConfig.from_dict(json.loads(json.dumps(config)))
    model_config.text_config = module.TextConfig.from_dict(text)
    model_config.vision_config = module.VisionConfig.from_dict(vision)
    model = module.Model(model_config)
    weights = {k: v * 4 if v.ndim == 2 else v for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(config))
    processor = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor"}.get(
        family, "Qwen3VLProcessor"
    )
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "patch_size": patch_size,
        "merge_size": 2, "temporal_patch_size": 2, "min_pixels": 16 * 16,
        "max_pixels": max_pixels, "do_resize": True, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "do_convert_rgb": True, "processor_class": processor,
    }))  # fmt: skip
    (path / "processor_config.json").write_text(json.dumps({"processor_class": processor}))
    return path
