"""A tiny random-weight llama that mlx_lm.load opens, with a ChatML byte-level tokenizer.

Built locally so tests need no model hub: 2 layers, hidden size 64, untied
lm_head (so greedy output varies with the input), GQA with 4 query / 2 KV heads.
The vocabulary is printable ASCII plus newline, one token per character, and
the ChatML special tokens: whatever the model generates decodes to text that
encodes back to the same tokens, so a chat's next turn can reuse the reply.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import llama, qwen2
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
UNK = "<unk>"
THINK = ["<think>", "</think>"]
CHARS = [10, *range(32, 127)]  # newline and printable ASCII

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Hermes-style tool calling, as Qwen2.5's template does it: tools listed in the system turn,
# calls as <tool_call>{"name": ..., "arguments": ...}</tool_call>, results as user turns. mlx-lm
# infers its "json_tools" parser from the markers.
TOOLS_CHATML = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    'Call a function as <tool_call>{"name": ..., "arguments": ...}</tool_call>.'
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and tools %}"
    "{% elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{ '<|im_start|>assistant\n' }}{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% for tool_call in message['tool_calls'] %}{% set tool_call = tool_call['function'] %}"
    '<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": '
    "{{ tool_call.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response>"
    "<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A reasoning model's template, as DeepSeek-R1's: the generation prompt opens the thinking,
# and an assistant turn's `reasoning_content`, when sent back, is written as it was generated.
THINK_CHATML = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% if message.get('reasoning_content') is not none %}"
    "{{ '<think>\n' + message['reasoning_content'] + '\n</think>\n\n' }}{% endif %}"
    "{{ message['content'] + '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n' }}{% endif %}"
)

CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": len(CHARS) + 1 + len(SPECIAL),
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


def _byte_level_char(b: int) -> str:
    # GPT-2's byte-to-unicode map: printable bytes stand for themselves, the rest shift.
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    if b in printable:
        return chr(b)
    return chr(256 + [x for x in range(256) if x not in printable].index(b))


def build_tokenizer(special: list[str] = SPECIAL) -> Tokenizer:
    vocab = {_byte_level_char(b): i for i, b in enumerate(CHARS)}
    vocab[UNK] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(special)
    return tok


def write_tokenizer(
    path: Path,
    special: list[str],
    chat_template: str,
    named: dict[str, str | None] | None = None,
    max_length: int = CONFIG["max_position_embeddings"],
) -> None:
    """The tokenizer's files in `path`: `build_tokenizer(special)` and its settings."""
    build_tokenizer(special).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                **(named or {}),
                "unk_token": UNK,
                "chat_template": chat_template,
                "model_max_length": max_length,
            }
        )
    )


def build_tiny_model(
    path: Path,
    seed: int = 0,
    chat_template: str = CHATML,
    thinking: bool = False,
    special: list[str] | None = None,
    named: dict[str, str | None] | None = None,
    **config: int,
) -> Path:
    """Write the model folder to `path` (created) and return it; `config` overrides CONFIG.
    `thinking`: `<think>` and `</think>` are special tokens too, as in Qwen3's vocabulary.
    `special` replaces the ChatML special tokens (a real template's own), and `named` sets
    the tokenizer's `bos_token`, `eos_token` and `pad_token` among them."""
    path.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    special = (SPECIAL if special is None else special) + (THINK if thinking else [])
    config = {**CONFIG, "vocab_size": len(CHARS) + 1 + len(special), **config}
    # qwen2 for a model mlx-lm can split by layers as well as by heads (`--pipeline`).
    arch = qwen2 if config["model_type"] == "qwen2" else llama
    model = arch.Model(arch.ModelArgs.from_dict(config))
    # Larger than default init so logits are far from ties and outputs vary.
    weights = {k: v * 4 if v.ndim == 2 else v for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(config))
    write_tokenizer(path, special, chat_template, named, config["max_position_embeddings"])
    return path


def build_agent_model(tokenizer_dir: Path, path: Path, reply: str = "Hello there!",
                      context: int = 32768, chat_template: str | None = None,
                      template_kwargs: dict | None = None) -> Path:  # fmt: skip
    """A tiny model under `tokenizer_dir`'s tokenizer and template that answers any chat with
    `reply` and its end token, for real agent clients that need a turn to end.
    `chat_template` replaces the tokenizer's own (TOOLS_CHATML, for one that knows tools);
    `template_kwargs` render the generation prompt as the server will (mlx-lm turns a
    thinking model's `enable_thinking` on).

    Its embeddings are scaled far above what each layer adds (every layer's input is
    normalized), so the last hidden state is the current token's embedding, nearly: the
    model is a bigram table, and `lm_head` rows written from the embeddings chain the
    generation prompt's last token to the reply's tokens, then to the end token.
    """
    from transformers import AutoTokenizer

    path.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).exists():
            (path / name).write_bytes((tokenizer_dir / name).read_bytes())
    if chat_template is not None:
        settings = json.loads((path / "tokenizer_config.json").read_text())
        settings["chat_template"] = chat_template
        (path / "tokenizer_config.json").write_text(json.dumps(settings))
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    mx.random.seed(0)
    config = {**CONFIG, "vocab_size": vocab, "max_position_embeddings": context}
    model = llama.Model(llama.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    embed = weights["model.embed_tokens.weight"] * 100
    head = weights["lm_head.weight"]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                         add_generation_prompt=True,
                                         **(template_kwargs or {}))  # fmt: skip
    prompt = tokenizer.encode(text, add_special_tokens=False)
    chain = [prompt[-1], *tokenizer.encode(reply, add_special_tokens=False)]
    chain.append(tokenizer.convert_tokens_to_ids(tokenizer.eos_token))
    assert len(set(chain)) == len(chain), "each token of the chain must be a new one"
    for prev, nxt in zip(chain[:-1], chain[1:], strict=True):
        unit = embed[prev] / mx.sqrt(mx.mean(embed[prev] ** 2))
        head[nxt] = unit * 4  # a logit of 4 * hidden_size: far above any other row's
    weights["model.embed_tokens.weight"], weights["lm_head.weight"] = embed, head
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(config))
    return path
