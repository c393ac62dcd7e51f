"""What `mlx_adapter/model_patches.py` relies on in mlx-lm and MLX, pinned: an mlx-lm or MLX
release that changes one of these fails here, by name, before the fast path silently stops
taking a model's calls."""

from __future__ import annotations

import importlib

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import activations, base, llama

from mlx_cache_server.mlx_adapter import model_patches
from mlx_cache_server.runtime import cpu_activations, cpu_attention, cpu_logprobs

ATTENTION, SWIGLU = "scaled_dot_product_attention", "swiglu"


def tiny_llama() -> llama.Model:
    args = llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=100,
    )  # fmt: skip
    mx.random.seed(0)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


# Architectures people serve most, each calling mlx-lm's attention (and most its SwiGLU).
COMMON = ("llama", "qwen2", "qwen3", "qwen3_moe", "gemma3_text", "phi3", "mistral3", "granite")


def test_model_modules_bind_attention_and_swiglu_by_name_from_their_homes():
    """`rebind` finds mlx-lm's functions at these names in the model modules: each that
    has the name binds mlx-lm's own (or ours, where a model of it was loaded here)."""
    homes = {ATTENTION: (base, cpu_attention), SWIGLU: (activations, cpu_activations)}
    bound = {ATTENTION: [], SWIGLU: []}
    for module in (importlib.import_module(f"mlx_lm.models.{m}") for m in COMMON):
        for name, (home, ours) in homes.items():
            if module is home or not hasattr(module, name):
                continue
            found = getattr(module, name)
            if found is getattr(home, name) or found is getattr(ours, name):
                bound[name].append(module.__name__.rpartition(".")[2])
    assert bound[ATTENTION] == [m for m in COMMON if m != "mistral3"]  # a wrapper: below
    assert {"llama", "qwen2", "qwen3"} <= set(bound[SWIGLU])


def test_llama_s_attention_and_mlp_call_them_through_their_module_globals():
    assert ATTENTION in llama.Attention.__call__.__code__.co_names
    assert SWIGLU in llama.MLP.__call__.__code__.co_names


def test_rebind_routes_a_models_calls_and_leaves_the_home_module_alone(monkeypatch):
    monkeypatch.setattr(llama, SWIGLU, activations.swiglu)  # mlx-lm's, undone after the test
    model, calls = tiny_llama(), []
    tokens = mx.array([[1, 2, 3]])
    before = np.asarray(model(tokens))

    def spy(gate, x):
        calls.append(gate.shape)
        return activations.swiglu(gate, x)

    assert model_patches.rebind(model, SWIGLU, activations.swiglu, spy, home=activations)
    assert llama.swiglu is spy and activations.swiglu is not spy
    assert model_patches.called_by(model.layers[0].mlp, SWIGLU) is spy
    assert np.array_equal(np.asarray(model(tokens)), before)
    assert len(calls) == len(model.layers)
    # a name no module of the model binds to that function: nothing is rebound
    assert not model_patches.rebind(model, "swish", activations.swiglu, spy, home=activations)
    assert not hasattr(llama, "swish")


def test_generate_normalizes_through_its_module_global_mx():
    step = model_patches.GENERATE.GenerationBatch._step.__code__
    assert {"mx", "logsumexp"} <= set(step.co_names)
    assert model_patches.GENERATE.__name__ == "mlx_lm.generate"


def test_route_generate_gives_generate_a_namespace_holding_ours_alone(monkeypatch):
    monkeypatch.setattr(model_patches.GENERATE, "mx", mx)  # MLX's, undone after the test
    assert model_patches.route_generate("logsumexp", cpu_logprobs.logsumexp)
    assert not model_patches.route_generate("logsumexp", cpu_logprobs.logsumexp)
    routed = model_patches.GENERATE.mx
    assert routed.logsumexp is cpu_logprobs.logsumexp and mx.logsumexp is not routed.logsumexp
    assert routed.array is mx.array and routed.eval is mx.eval


def test_a_module_is_a_dict_of_its_arrays_and_children_lists_included():
    model = tiny_llama()
    inner = model.model
    assert model in model.modules() and inner.layers[1].mlp in model.modules()
    assert isinstance(inner["layers"], list) and inner["layers"][0] is inner.layers[0]
    assert inner["norm"] is inner.norm and "weight" in inner.norm
    order = [id(m) for m in model.modules()]  # a module before the modules it holds
    assert (
        order.index(id(inner))
        < order.index(id(inner.layers[0]))
        < order.index(id(inner.layers[0].self_attn.rope))
    )


def test_replace_modules_and_recast_keep_the_arrays_and_the_output():
    model = tiny_llama()
    tokens = mx.array([[5, 6, 7, 8]])
    before = np.asarray(model(tokens))
    arrays = {k: id(v) for k, v in tree_flatten(model.parameters())}

    class Norm(nn.RMSNorm):
        calls = 0

        def __call__(self, x: mx.array) -> mx.array:
            Norm.calls += 1
            return super().__call__(x)

    class Block(llama.TransformerBlock):
        pass

    def ours(child):
        if type(child) is nn.RMSNorm:
            return model_patches.recast(child, Norm)
        return model_patches.recast(child, Block) if type(child) is llama.TransformerBlock else None

    old = model.layers[0]
    assert model_patches.replace_modules(model, ours) == 2 * 2 + 1 + 2  # norms, last, blocks
    new = model.layers[0]
    assert type(new) is Block and new is not old and type(old) is llama.TransformerBlock
    assert new.self_attn is old.self_attn and new.args is old.args
    assert new.use_sliding == old.use_sliding and new.training == old.training
    assert {k: id(v) for k, v in tree_flatten(model.parameters())} == arrays
    assert np.array_equal(np.asarray(model(tokens)), before)
    assert Norm.calls == 2 * 2 + 1


def test_the_parts_a_llama_block_of_ours_reads():
    """`runtime/kernel_block.py` and `kernel_layers.py` read these of mlx-lm's modules."""
    layer = tiny_llama().layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "rope", "n_heads", "n_kv_heads", "scale"):
        assert hasattr(attn, name), name
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert type(getattr(mlp, name)) is nn.Linear, name
    assert type(layer.input_layernorm) is type(layer.post_attention_layernorm) is nn.RMSNorm
    rope = attn.rope
    assert type(rope) is nn.RoPE
    assert {"dims", "traditional", "base", "scale"} <= set(vars(rope))
    assert layer.input_layernorm.eps > 0


@pytest.mark.parametrize("name", ["rope", "rms_norm"])
def test_mlx_fast_functions_the_replaced_modules_fall_back_to(name):
    assert callable(getattr(mx.fast, name))


def test_the_fast_path_changes_mlx_lm_s_objects_only_through_the_adapter():
    """In `runtime/`, no attribute of an imported module or class is assigned, no `setattr`
    is called and no `__class__` is assigned: each change the fast path makes to mlx-lm's
    objects is one of `model_patches`' (read with `ast`, as the code is)."""
    import ast
    from pathlib import Path

    root = Path(cpu_attention.__file__).parent
    found = []
    for path in sorted(root.glob("*.py")):
        tree = ast.parse(path.read_text())
        imported = {
            (a.asname or a.name).split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import | ast.ImportFrom)
            for a in node.names
        }
        imported |= {  # `x = importlib.import_module(...)`
            t.id
            for node in ast.walk(tree)
            if isinstance(node, ast.Assign) and "import_module" in ast.unparse(node.value)
            for t in node.targets
            if isinstance(t, ast.Name)
        }
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            if isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            for t in targets:
                if isinstance(t, ast.Attribute) and (
                    t.attr == "__class__"
                    or isinstance(t.value, ast.Name)
                    and t.value.id in imported
                ):
                    found.append(f"{path.name}:{node.lineno} {ast.unparse(t)}")
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr":
                found.append(f"{path.name}:{node.lineno} setattr")
    assert found == []
