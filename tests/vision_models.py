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
    # Larger than default init so logits are far from ties and outputs vary.
    weights = {k: v * 4 if v.ndim == 2 else v for k, v in tree_flatten(model.parameters())}
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
