"""Tiny random-weight hybrid models that mlx_lm.load opens, with tests.tiny_model's tokenizer.

Same recipe as `tests.tiny_model.build_tiny_model`: the mlx-lm model class's own random
init, 2-D weights scaled so logits are far from ties and greedy output varies, saved with
`mx.save_safetensors` under the parameter names the model itself uses (so each arch's
`sanitize` leaves them alone on load), a config.json with "model_type", and the byte-level
ChatML tokenizer.

Each config is a real hybrid, as the full model is:

- gemma3_text: sliding-window layers (RotatingKVCache) beside global ones (KVCache),
  every `sliding_window_pattern`-th layer global; window 16.
- gpt_oss: alternating sliding / full attention (`layer_types`), attention sinks, MoE; window 16.
- qwen3_next: gated-delta-net linear attention (ArraysCache(2)) beside gated full attention
  (KVCache) every `full_attention_interval`-th layer; MoE with a shared expert.
- qwen3_5: the same layer mix, dense MLP (flat config; the model wraps it as text_config).
- nemotron_h: Mamba2 ("M", ArraysCache(2)), attention ("*", KVCache) and MLP ("-", no cache)
  blocks from `hybrid_override_pattern`; the cache list is shorter than the layer list.
- lfm2: short-conv layers (ArraysCache(1)) beside attention (KVCache); tied embeddings.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from tests.tiny_model import CHARS, CHATML, SPECIAL, write_tokenizer

VOCAB = len(CHARS) + 1 + len(SPECIAL)

_COMMON = {
    "vocab_size": VOCAB,
    "max_position_embeddings": 4096,
}

CONFIGS: dict[str, dict] = {
    "gemma3_text": {
        **_COMMON,
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "num_hidden_layers": 6,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        # Layers 2 and 5 global, the rest sliding (the full model: 5 local to 1 global).
        "sliding_window": 16,
        "sliding_window_pattern": 3,
    },
    "gpt_oss": {
        **_COMMON,
        "model_type": "gpt_oss",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    },
    "qwen3_next": {
        **_COMMON,
        "model_type": "qwen3_next",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        # Layers 1 and 3 full attention, 0 and 2 gated delta net.
        "full_attention_interval": 2,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
    },
    "qwen3_5": {
        **_COMMON,
        "model_type": "qwen3_5",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "full_attention_interval": 2,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
    },
    "nemotron_h": {
        **_COMMON,
        "model_type": "nemotron_h",
        "hidden_size": 64,
        # M = Mamba2, * = attention, - = MLP; num_hidden_layers follows from it.
        "hybrid_override_pattern": "M-M*-M*-",
        "num_hidden_layers": 8,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "attention_bias": False,
        "mamba_num_heads": 8,
        "mamba_head_dim": 16,
        "mamba_proj_bias": False,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "n_groups": 2,
        "mlp_bias": False,
        "layer_norm_epsilon": 1e-5,
        "use_bias": False,
        "use_conv_bias": True,
        "tie_word_embeddings": False,
    },
    "lfm2": {
        **_COMMON,
        "model_type": "lfm2",
        "hidden_size": 64,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 64,
        "block_ff_dim": 192,
        "block_multiple_of": 32,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": True,
        "rope_theta": 1_000_000.0,
        "layer_types": ["conv", "conv", "full_attention", "conv", "full_attention", "conv"],
        "full_attn_idxs": [2, 4],
        "tie_embedding": True,
    },
}

# Per-arch factor for the random init's weights (2-D as in build_tiny_model; 3-D stacked
# expert weights too, for the MoE archs, so the experts are not drowned by the shared path).
SCALE: dict[str, float] = {
    "gemma3_text": 4.0,
    "gpt_oss": 4.0,
    "qwen3_next": 4.0,
    "qwen3_5": 4.0,
    "nemotron_h": 4.0,
    "lfm2": 4.0,
}


def has_arch(arch: str) -> bool:
    """Whether the installed mlx-lm has `mlx_lm/models/<arch>.py`."""
    try:
        importlib.import_module(f"mlx_lm.models.{arch}")
    except ImportError:
        return False
    return True


ARCHS = [a for a in CONFIGS if has_arch(a)]


def _scale(key: str, v: mx.array, factor: float) -> mx.array:
    if v.ndim == 2:
        return v * factor
    # Stacked expert weights (SwitchLinear: experts x out x in), not conv kernels.
    if v.ndim == 3 and ("experts" in key or "switch_mlp" in key) and key.endswith("weight"):
        return v * factor
    return v


def build_hybrid_model(path: Path, arch: str, seed: int = 0, **config) -> Path:
    """Write a tiny `arch` model folder to `path` (created) and return it; `config`
    overrides CONFIGS[arch] (e.g. sliding_window=32, num_hidden_layers=8)."""
    if arch not in CONFIGS:
        raise ValueError(f"unknown arch {arch!r}, expected one of {sorted(CONFIGS)}")
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    path.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    config = {**CONFIGS[arch], **config}
    if arch == "nemotron_h":
        config["num_hidden_layers"] = len(config["hybrid_override_pattern"])
    model = module.Model(module.ModelArgs.from_dict(config))
    factor = SCALE[arch]
    weights = {k: _scale(k, v, factor) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(config))
    write_tokenizer(path, SPECIAL, CHATML, max_length=config["max_position_embeddings"])
    return path
