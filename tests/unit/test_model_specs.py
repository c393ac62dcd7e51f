"""The models configuration: [[models]] tables and --model flags, checked at start."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlx_cache_server.models.specs import ModelSpec, check_paths, model_specs
from mlx_cache_server.settings import Settings, load_settings

CONFIG = """
model_ttl = 600
memory_budget = "2GiB"

[[models]]
id = "chat"
path = "/models/qwen"
aliases = ["gpt-4o"]
pinned = true
temperature = 0.6
max_tokens = 512
chat_template_kwargs = { enable_thinking = false }

[[models]]
path = "/models/small.gguf"
ttl = 30
cache_max_bytes = "64MiB"
working_memory = "128MiB"
"""


def test_a_settings_file_lists_models_with_their_own_settings(tmp_path: Path):
    config = tmp_path / "models.toml"
    config.write_text(CONFIG)
    settings = load_settings(config, {})
    assert settings.memory_budget == 2 * 1024**3
    chat, small = model_specs(settings, "default-model")
    assert chat == ModelSpec(
        "chat", "/models/qwen", ("gpt-4o",), pinned=True, ttl=600.0,
        overrides={"temperature": 0.6, "default_max_tokens": 512,
                   "chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    assert small.id == "small" and small.ttl == 30 and small.working_memory == 128 * 1024**2
    # Each model runs with the server's settings under its own.
    own = chat.settings(settings)
    assert own.temperature == 0.6 and own.default_max_tokens == 512
    assert own.served_model_name == "chat" and own.model_aliases == ["gpt-4o"]
    assert own.chat_template_kwargs == {"enable_thinking": False}
    assert small.settings(settings).cache_max_bytes == 64 * 1024**2
    assert small.settings(settings).temperature is None


def test_the_flags_model_comes_first_and_answers_to_default():
    settings = Settings(model="/m/first", served_model_name="first", models=[{"path": "/m/x"}])
    first, second = model_specs(settings, "embedded")
    assert (first.id, second.id) == ("first", "/m/x")
    assert model_specs(Settings(), "embedded")[0] == ModelSpec("embedded", None)


@pytest.mark.parametrize(
    "tables, message",
    [
        ([{"id": "x"}], "'path'"),
        ([{"path": "/a", "tempreature": 1}], "unknown keys tempreature"),
        ([{"path": "/a", "ttl": -1}], "'ttl'"),
        # TOML's true is not a number (Python's bool is an int: it would pass as 1).
        ([{"path": "/a", "ttl": True}], "'ttl' must be a positive number"),
        ([{"path": "/a", "temperature": True}], "'temperature': expected a number, not true"),
        ([{"path": "/a", "context_length": False}], "'context_length': expected a number"),
        ([{"path": "/a", "cache_max_bytes": True}], "'cache_max_bytes': not a size: true"),
        ([{"path": "/a", "working_memory": True}], "'working_memory': not a size: true"),
        ([{"path": "/a", "aliases": [1]}], "'aliases'"),
        ([{"path": "/a", "pooling": "max"}], "'pooling'"),
        ([{"path": "/a", "pinned": "false"}], "'pinned' must be true or false"),
        ([{"path": "/a", "temperature": "hot"}], "'temperature': could not convert"),
        ([{"path": "/m/a"}, {"path": "/n/a"}], "two models"),
        ([{"path": "/m/a", "id": "x"}, {"path": "/n/b", "id": "x"}], "two models have the id 'x'"),
        ([{"path": "/a", "id": "m"}, {"path": "/b", "aliases": ["m"]}], "two models"),
        ([{"path": "/a", "id": "default-model"}], "two models"),
    ],
)
def test_mistakes_in_the_models_are_named_at_start(tables, message):
    with pytest.raises(ValueError, match=message):
        model_specs(Settings(model="/default-model", models=tables), "embedded")


def test_a_true_for_a_number_at_the_settings_files_top_level_is_refused(tmp_path):
    config = tmp_path / "s.toml"
    for line, message in [("model_ttl = true", "expected a number, not true"),
                          ("memory_budget = true", "not a size: true")]:  # fmt: skip
        config.write_text(line + "\n")
        with pytest.raises(ValueError, match=message):
            load_settings(config, {})


def test_the_example_settings_files_load(tmp_path):
    root = Path(__file__).parents[2] / "configs"
    for name in ("server.example.toml", "models.example.toml"):
        settings = load_settings(root / name, {})
        check_paths(model_specs(settings, "embedded"))  # its header's command starts as it is
    chat, fast = model_specs(load_settings(root / "models.example.toml", {}), "x")
    assert chat.pinned and fast.overrides["chat_template_kwargs"] == {"enable_thinking": False}
    # Its commented-out GGUF table, uncommented, is a model too.
    head, tail = (root / "models.example.toml").read_text().split("# [[models]]")
    tail = "\n".join(line.removeprefix("# ") for line in ("[[models]]" + tail).splitlines())
    (tmp_path / "m.toml").write_text(head + tail)
    *_, autocomplete = model_specs(load_settings(tmp_path / "m.toml", {}), "x")
    assert autocomplete.path.endswith(".gguf") and autocomplete.id == "autocomplete"
    assert autocomplete.overrides["default_max_tokens"] == 256 and autocomplete.ttl == 300


def test_names_for_the_flags_model_are_refused_when_only_tables_name_models():
    with pytest.raises(ValueError, match="served_model_name names the model of --model"):
        model_specs(Settings(served_model_name="x", models=[{"path": "/a"}]), "embedded")


def test_the_servers_sampling_and_cache_settings_apply_to_every_model_under_its_own():
    base = Settings(temperature=0.2, default_max_tokens=99, context_length=1024, kv_bits=8)
    first, second, third = model_specs(
        Settings(model="/m/first", models=[{"path": "/m/x"}, {"path": "/m/y", "kv_bits": 4}]),
        "embedded",
    )
    for spec in (first, second, third):  # as the README says: not the first model's alone
        own = spec.settings(base)
        assert (own.temperature, own.default_max_tokens, own.context_length) == (0.2, 99, 1024)
    assert second.settings(base).kv_bits == 8 and third.settings(base).kv_bits == 4


def test_a_models_template_variables_go_over_the_servers():
    base = Settings(chat_template_kwargs={"enable_thinking": True, "style": "short"})
    (spec,) = model_specs(
        Settings(models=[{"path": "/a", "chat_template_kwargs": {"enable_thinking": False}}]),
        "embedded",
    )
    assert spec.settings(base).chat_template_kwargs == {"enable_thinking": False, "style": "short"}


def test_a_local_path_that_does_not_exist_is_named_at_start(tmp_path):
    specs = model_specs(Settings(models=[{"path": str(tmp_path / "gone")}, {"path": "org/m"}]), "e")
    with pytest.raises(ValueError, match="gone does not exist"):
        check_paths(specs)
    check_paths(specs[1:])  # a hub id: known only when fetched
