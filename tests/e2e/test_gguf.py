"""GGUF import: a tiny llama written as GGUF by the test comes back as the same model."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm import load
from mlx_lm.models import llama

from mlx_cache_server.cli import main
from mlx_cache_server.models.gguf import GGUFError, import_gguf, unpermute

CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": 300,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)
GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def permute(w, n_head):
    """llama.cpp's converter: HF rows -> GGUF rows."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_name(name: str) -> str:
    if name.startswith("model.layers."):
        _, _, i, rest = name.split(".", 3)
        module, param = rest.rsplit(".", 1)
        return f"blk.{i}.{GGUF_NAMES[module]}.{param}"
    return {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }[name]


def byte_vocab():
    from tokenizers import pre_tokenizers

    chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = ["Ġ t", "h e", "Ġt he"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *chars, "Ġt", "he", "Ġthe"]
    return tokens, merges


def write_gguf(path: Path, arch: str = "llama", tokenizer_model: str = "gpt2"):
    mx.random.seed(3)
    model = llama.Model(llama.ModelArgs.from_dict(CONFIG))
    source = dict(tree_flatten(model.parameters()))
    tensors = {}
    for name, w in source.items():
        if name.endswith("q_proj.weight"):
            w = permute(w, CONFIG["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = permute(w, CONFIG["num_key_value_heads"])
        if "mlp" in name:
            w = w.astype(mx.float16)  # a mix of F32 and F16 tensors
        tensors[gguf_name(name)] = w
    tokens, merges = byte_vocab()
    meta = {
        "general.architecture": arch,
        f"{arch}.embedding_length": mx.array(64, dtype=mx.uint32),
        f"{arch}.block_count": mx.array(2, dtype=mx.uint32),
        f"{arch}.feed_forward_length": mx.array(96, dtype=mx.uint32),
        f"{arch}.attention.head_count": mx.array(4, dtype=mx.uint32),
        f"{arch}.attention.head_count_kv": mx.array(2, dtype=mx.uint32),
        f"{arch}.attention.layer_norm_rms_epsilon": mx.array(1e-5, dtype=mx.float32),
        f"{arch}.rope.freq_base": mx.array(10000.0, dtype=mx.float32),
        f"{arch}.context_length": mx.array(512, dtype=mx.uint32),
        f"{arch}.vocab_size": mx.array(300, dtype=mx.uint32),
        "tokenizer.ggml.model": tokenizer_model,
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": tokens + [f"<pad{i}>" for i in range(300 - len(tokens))],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": mx.array([3, 3, 3] + [1] * 297, dtype=mx.int32),
        "tokenizer.ggml.eos_token_id": mx.array(2, dtype=mx.uint32),
        "tokenizer.chat_template": TEMPLATE,
    }
    mx.save_gguf(str(path), tensors, meta)
    return model, source


def test_imported_model_matches_the_source(tmp_path):
    source_model, source = write_gguf(tmp_path / "tiny.gguf")
    out = import_gguf(tmp_path / "tiny.gguf", tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["num_key_value_heads"] == 2 and config["max_position_embeddings"] == 512
    model, tokenizer = load(str(out))
    imported = dict(tree_flatten(model.parameters()))
    assert set(imported) == set(source)
    for name, w in source.items():
        if "mlp" in name:
            w = w.astype(mx.float16)  # what the file held
        np.testing.assert_array_equal(np.array(imported[name]), np.array(w.astype(mx.float32)))
    # The same weights in mlx-lm's own llama give the same logits: RoPE layout included.
    rounded = [(k, v.astype(mx.float16) if "mlp" in k else v) for k, v in source.items()]
    source_model.update(tree_unflatten([(k, v.astype(mx.float32)) for k, v in rounded]))
    x = mx.array([[5, 17, 42, 99, 7]])
    np.testing.assert_allclose(np.array(model(x)), np.array(source_model(x)), rtol=1e-5)
    ids = tokenizer.encode("the theme", add_special_tokens=False)
    assert tokenizer.decode(ids) == "the theme"
    assert len(ids) < len("the theme")  # the merges were applied
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n"
    assert tokenizer.encode("<|im_end|>", add_special_tokens=False) == [2]
    assert tokenizer.eos_token_ids == {2}


def test_unpermute_inverts_the_converter():
    w = mx.arange(8 * 3).reshape(8, 3)
    assert mx.array_equal(unpermute(permute(w, 2), 2), w)


def test_unsupported_inputs_are_named(tmp_path):
    write_gguf(tmp_path / "arch.gguf", arch="falcon")
    with pytest.raises(GGUFError, match="unsupported architecture 'falcon'"):
        import_gguf(tmp_path / "arch.gguf", tmp_path / "a")
    write_gguf(tmp_path / "spm.gguf", tokenizer_model="llama")
    with pytest.raises(GGUFError, match="unsupported tokenizer model 'llama'"):
        import_gguf(tmp_path / "spm.gguf", tmp_path / "b")
    with pytest.raises(GGUFError, match="unsupported dtype"):
        import_gguf(tmp_path / "spm.gguf", tmp_path / "c", dtype="int3")


def test_cli_import_reports_errors(tmp_path, capsys):
    write_gguf(tmp_path / "ok.gguf")
    assert main(["import-gguf", str(tmp_path / "ok.gguf"), str(tmp_path / "ok")]) == 0
    assert (tmp_path / "ok" / "tokenizer.json").exists()
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file")
    assert main(["import-gguf", str(tmp_path / "bad.gguf"), str(tmp_path / "bad")]) == 1
    assert "cannot read" in capsys.readouterr().err
