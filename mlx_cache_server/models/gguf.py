"""Import a llama- or qwen2-family GGUF file into a folder `mlx_lm.load` opens.

`mlx.core.load` reads GGUF tensors (F32, F16, and Q4_0/Q4_1/Q8_0 as MLX
quantized triples) and metadata. From those this writes config.json, weights
renamed to mlx-lm's layout, a `tokenizers` tokenizer.json built from the GGUF
vocabulary and merges, and tokenizer_config.json with the chat template.

llama.cpp's converter permutes the rows of llama Q and K projections (for
interleaved RoPE); they are permuted back here, so the folder uses the same
layout and RoPE as a Hugging Face checkpoint. qwen2 files are not permuted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

ARCHITECTURES = ("llama", "qwen2")
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
GROUP_SIZE = 32  # every GGUF block type mlx reads has 32-element blocks

_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# Pre-tokenizer regexes by GGUF `tokenizer.ggml.pre`, as llama.cpp applies them.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE = {
    "default": (_GPT2, False),
    "gpt2": (_GPT2, False),
    "smollm": (_GPT2, True),  # digits one by one, then GPT-2's split
    "qwen2": (_QWEN2, False),
    "llama-bpe": (_LLAMA3, False),
}


class GGUFError(ValueError):
    """The file cannot be imported; the message says what is unsupported."""


def import_gguf(
    src: Path,
    out: Path,
    *,
    dtype: str = "float32",
    keep_quantized: bool = False,
    progress: Callable[[str], None] = lambda _: None,
) -> Path:
    if dtype not in DTYPES:
        raise GGUFError(f"unsupported dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    progress(f"reading {src}")
    try:
        tensors, meta = mx.load(str(src), return_metadata=True)
    except (RuntimeError, ValueError) as e:
        raise GGUFError(f"cannot read {src}: {e} (supported: F32, F16, Q4_0, Q4_1, Q8_0)") from e
    arch = _text(meta, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"unsupported architecture {arch!r}; this importer handles {', '.join(ARCHITECTURES)}"
        )
    config = _config(meta, arch, tied="output.weight" not in tensors)
    progress(f"converting {len(tensors)} tensors ({arch}, {config['num_hidden_layers']} layers)")
    weights, quantization = _weights(tensors, config, arch, DTYPES[dtype], keep_quantized)
    if quantization:
        config["quantization"] = quantization
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    progress("building the tokenizer")
    tokenizer, tokenizer_config = _tokenizer(meta)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    progress(f"wrote {out}")
    return out


def _value(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    value = meta.get(key, default)
    if isinstance(value, mx.array):
        value = value.item() if value.size == 1 else value.tolist()
    return value


def _text(meta: dict[str, Any], key: str) -> str:
    value = _value(meta, key)
    if value is None:
        raise GGUFError(f"the file has no {key!r} metadata")
    return str(value)


def _config(meta: dict[str, Any], arch: str, tied: bool) -> dict[str, Any]:
    def need(name: str) -> Any:
        value = _value(meta, f"{arch}.{name}")
        if value is None:
            raise GGUFError(f"the file has no {arch}.{name!r} metadata")
        return value

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    if _value(meta, f"{arch}.rope.scaling.type") not in (None, "none"):
        raise GGUFError("RoPE scaling is not supported by this importer")
    vocab = _value(meta, f"{arch}.vocab_size") or len(_value(meta, "tokenizer.ggml.tokens"))
    return {
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": int(need("block_count")),
        "intermediate_size": int(need("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_value(meta, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_value(meta, f"{arch}.attention.key_length", hidden // heads)),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_value(meta, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_value(meta, f"{arch}.context_length", 4096)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": tied,
    }


def _name(gguf_name: str) -> tuple[str, str]:
    """mlx-lm name of a GGUF tensor, as (module, parameter)."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(\w+)", gguf_name)
    if m:
        layer, part, param = m.groups()
        if part not in _LAYER:
            raise GGUFError(f"unsupported tensor {gguf_name!r}")
        return f"model.layers.{layer}.{_LAYER[part]}", param
    m = re.fullmatch(r"(\w+)\.(\w+)", gguf_name)
    if not m or m.group(1) not in _TOP:
        raise GGUFError(f"unsupported tensor {gguf_name!r}")
    return _TOP[m.group(1)], m.group(2)


def unpermute(w: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's row permutation of a Q or K projection (rows = heads x dim)."""
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _weights(
    tensors: dict[str, mx.array],
    config: dict[str, Any],
    arch: str,
    dtype: mx.Dtype,
    keep_quantized: bool,
) -> tuple[dict[str, mx.array], dict[str, Any] | None]:
    modules: dict[str, dict[str, mx.array]] = {}
    for name, value in tensors.items():
        module, param = _name(name)
        modules.setdefault(module, {})[param] = value
    out: dict[str, mx.array] = {}
    bits_of: dict[str, int] = {}
    for module, params in modules.items():
        heads = None
        if arch == "llama" and module.endswith("q_proj"):
            heads = config["num_attention_heads"]
        elif arch == "llama" and module.endswith("k_proj"):
            heads = config["num_key_value_heads"]
        quantized = "scales" in params
        bits = 0
        if quantized:
            bits = params["weight"].shape[-1] * 32 // (params["scales"].shape[-1] * GROUP_SIZE)
        if quantized and keep_quantized:
            # Rows stay whole under quantization, so the permutation applies as is.
            bits_of[module] = bits
            for param, value in params.items():
                out[f"{module}.{param}"] = unpermute(value, heads) if heads else value
            continue
        weight = params["weight"]
        if quantized:
            weight = mx.dequantize(
                weight, params["scales"], params["biases"], group_size=GROUP_SIZE, bits=bits
            )
        weight = weight.astype(dtype)
        out[f"{module}.weight"] = unpermute(weight, heads) if heads else weight
        if "bias" in params:
            out[f"{module}.bias"] = params["bias"].astype(dtype)
        mx.eval(out[f"{module}.weight"])
    if not bits_of:
        return out, None
    # mlx-lm reads per-module settings where a module differs from the default.
    common = max(set(bits_of.values()), key=list(bits_of.values()).count)
    quant: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": common}
    for module, bits in bits_of.items():
        if bits != common:
            quant[module] = {"group_size": GROUP_SIZE, "bits": bits}
    return out, quant


def _tokenizer(meta: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    kind = _text(meta, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(
            f"unsupported tokenizer model {kind!r}; only byte-level BPE ('gpt2') is imported"
        )
    pre = str(_value(meta, "tokenizer.ggml.pre", "default"))
    if pre not in _PRE:
        raise GGUFError(f"unsupported pre-tokenizer {pre!r}; known: {', '.join(_PRE)}")
    tokens = list(_value(meta, "tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in _value(meta, "tokenizer.ggml.merges", [])]
    types = _value(meta, "tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    regex, digits = _PRE[pre]
    splits = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    splits += [
        pre_tokenizers.Split(Regex(regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]
    tok.pre_tokenizer = pre_tokenizers.Sequence(splits)
    tok.decoder = decoders.ByteLevel()
    # Control (3) and user-defined (4) tokens are matched whole, never split.
    special = [
        t for t, kind in zip(tokens, np.asarray(types).tolist(), strict=True) if kind in (3, 4)
    ]
    tok.add_special_tokens(special)

    def token(key: str) -> str | None:
        index = _value(meta, f"tokenizer.ggml.{key}_token_id")
        return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "pad_token": token("padding"),
        "unk_token": token("unknown"),
        "add_bos_token": bool(_value(meta, "tokenizer.ggml.add_bos_token", False)),
        "model_max_length": 1 << 30,
    }
    template = _value(meta, "tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return tok, config
