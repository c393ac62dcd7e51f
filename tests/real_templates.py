"""Tiny random-weight models under the real chat templates of current models.

Each template in tests/fixtures/templates/ comes with the special tokens it writes (role
markers, call markers, `<think>`, bos and eos), each a single special token as in the real
model's vocabulary, and the real model's bos and eos: the template renders as it does for
the real model, and mlx-lm infers the tool parser it infers for the real model (from the
template, or for LFM2.5 from the vocabulary's call tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.tiny_model import build_tiny_model, write_tokenizer

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"

CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
HERMES = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
THINK = ["<think>", "</think>"]


@dataclass(frozen=True)
class RealTemplate:
    file: str
    model: str
    parser: str | None  # the tool parser mlx-lm infers for the real model
    think: bool  # `<think>` reasoning: the tokens are in the vocabulary
    special: tuple[str, ...]  # the special tokens, bos and eos among them
    bos: str | None
    eos: str
    pad: str | None = None

    @property
    def template(self) -> str:
        return (TEMPLATES / self.file).read_text()

    @property
    def named(self) -> dict[str, str | None]:
        return {"bos_token": self.bos, "eos_token": self.eos, "pad_token": self.pad}


def _t(file: str, model: str, parser: str | None, think: bool, special: list[str],
       bos: str | None, eos: str, pad: str | None = None) -> RealTemplate:  # fmt: skip
    tokens = [*special, *(THINK if think else [])]
    return RealTemplate(file, model, parser, think, tuple(dict.fromkeys(tokens)), bos, eos, pad)


REAL_TEMPLATES: dict[str, RealTemplate] = {
    t.file: t
    for t in [
        _t("Qwen3-Coder.jinja", "Qwen3-Coder", "qwen3_coder", False, CHATML + HERMES,
           None, "<|im_end|>", "<|endoftext|>"),
        _t("Qwen3.5-4B.jinja", "Qwen3.5", "qwen3_coder", True,
           CHATML + HERMES + ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                              "<|video_pad|>"], None, "<|im_end|>", "<|endoftext|>"),
        _t("Qwen-Qwen3-0.6B.jinja", "Qwen3", "json_tools", True, CHATML + HERMES,
           None, "<|im_end|>", "<|endoftext|>"),
        _t("Qwen-Qwen2.5-7B-Instruct.jinja", "Qwen2.5", "json_tools", False, CHATML + HERMES,
           None, "<|im_end|>", "<|endoftext|>"),
        _t("google-gemma-4-31B-it.jinja", "Gemma 4", "gemma4", False,
           ["<pad>", "<bos>", "<eos>", "<|turn>", "<turn|>", "<|channel>", "<channel|>",
            "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
            "<tool_response|>", '<|"|>', "<|think|>", "<|image|>", "<|audio|>", "<|video|>"],
           "<bos>", "<turn|>", "<pad>"),
        _t("openai-gpt-oss-120b.jinja", "gpt-oss", None, False,
           ["<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>",
            "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"],
           "<|startoftext|>", "<|return|>", "<|endoftext|>"),
        _t("GLM-4.7-Flash.jinja", "GLM-4.7", "glm47", True,
           ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
            "<|observation|>", *HERMES, "<arg_key>", "</arg_key>", "<arg_value>",
            "</arg_value>"], None, "<|user|>", "<|endoftext|>"),
        _t("moonshotai-Kimi-K2.jinja", "Kimi-K2", "kimi_k2", False,
           ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>",
            "<|im_system|>", "<|im_middle|>", "<|tool_calls_section_begin|>",
            "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_end|>",
            "<|tool_call_argument_begin|>", "<|media_start|>", "<|media_content|>",
            "<|media_end|>", "<|media_pad|>"], "[BOS]", "<|im_end|>", "[EOS]"),
        _t("MiniMax-M2.jinja", "MiniMax-M2", "minimax_m2", True,
           ["]~!b[", "]~b]", "[e~[", "<minimax:tool_call>", "</minimax:tool_call>"],
           "]~!b[", "[e~[", None),
        _t("meta-llama-Llama-3.1-8B-Instruct.jinja", "Llama 3.1", None, False,
           ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"],
           "<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>"),
        _t("Mistral-Small-3.2-24B-Instruct-2506.jinja", "Mistral Small 3.2", "mistral", False,
           ["<unk_pad>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]",
            "[/SYSTEM_PROMPT]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]",
            "[CALL_ID]", "[ARGS]", "[TOOL_RESULTS]", "[TOOL_CONTENT]", "[/TOOL_RESULTS]",
            "[IMG]"], "<s>", "</s>", "<unk_pad>"),
        _t("deepseek-ai-DeepSeek-V3.1.jinja", "DeepSeek-V3.1", None, True,
           ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
            "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
            "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁output▁begin｜>",
            "<｜tool▁output▁end｜>"], "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
           "<｜end▁of▁sentence｜>"),
        _t("NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja", "Nemotron 3 Nano", "qwen3_coder", True,
           ["<s>", "</s>", "<|im_start|>", "<|im_end|>", *HERMES], "<s>", "<|im_end|>", "</s>"),
        _t("NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", "Hermes 3", "json_tools", False,
           ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>", *HERMES,
            "<tools>", "</tools>"], "<|begin_of_text|>", "<|im_end|>", "<|end_of_text|>"),
        _t("ibm-granite-granite-4.0.jinja", "Granite 4.0", "json_tools", False,
           ["<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>", *HERMES],
           None, "<|end_of_text|>", "<|end_of_text|>"),
        # The template never names the call tokens: mlx-lm finds `pythonic` in the vocabulary.
        _t("LFM2.5-Instruct.jinja", "LFM2.5", "pythonic", False,
           ["<|pad|>", "<|startoftext|>", "<|im_start|>", "<|im_end|>", "<|tool_list_start|>",
            "<|tool_list_end|>", "<|tool_call_start|>", "<|tool_call_end|>",
            "<|tool_response_start|>", "<|tool_response_end|>"],
           "<|startoftext|>", "<|im_end|>", "<|pad|>"),
        _t("HuggingFaceTB-SmolLM3-3B.jinja", "SmolLM3", None, True,
           ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"],
           "<|begin_of_text|>", "<|im_end|>", "<|end_of_text|>"),
    ]
}  # fmt: skip


def write_template_tokenizer(path: Path, file: str) -> Path:
    """Only the tokenizer's files (all mlx-lm's tokenizer loader reads) under `file`'s template."""
    real = REAL_TEMPLATES[file]
    path.mkdir(parents=True, exist_ok=True)
    write_tokenizer(path, list(real.special), real.template, real.named)
    return path


def build_template_model(path: Path, file: str, seed: int = 0, **config: int) -> Path:
    """The tiny random-weight model under `file`'s template, its tokens and its bos and eos."""
    real = REAL_TEMPLATES[file]
    return build_tiny_model(path, seed, real.template, special=list(real.special),
                            named=real.named, **config)  # fmt: skip
