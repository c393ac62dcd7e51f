"""Each setting is declared once, in `Settings`: `serve`'s flags and the reference in
docs/configuration.md are generated from it, and the flags the command has always taken
set what they always set."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from mlx_cache_server.cli import _parser, settings_of
from mlx_cache_server.setting_flags import with_reference
from mlx_cache_server.settings import Settings, load_settings

DOC = Path(__file__).parents[2] / "docs" / "configuration.md"
GiB, MiB = 1024**3, 1024**2

# Every flag of `serve` before the flags were generated, and what each sets.
FLAGS = [
    (["--served-model-name", "x"], "served_model_name", "x"),
    (["--model-alias", "a", "--model-alias", "b"], "model_aliases", ["a", "b"]),
    (["--answer-any-model", "OFF"], "answer_any_model", "off"),  # added with issue 59
    (["--memory-budget", "16GiB"], "memory_budget", 16 * GiB),
    (["--model-ttl", "60"], "model_ttl", 60.0),
    (["--working-memory", "1MiB"], "working_memory", MiB),
    (["--model-load-timeout", "5"], "model_load_timeout", 5.0),
    (["--host", "0.0.0.0"], "host", "0.0.0.0"),
    (["--port", "9000"], "port", 9000),
    (["--cache-max-sequences", "3"], "cache_max_sequences", 3),
    (["--cache-max-bytes", "2GB"], "cache_max_bytes", 2 * 10**9),
    (["--no-cache"], "no_cache", True),
    (["--cache-dir", "/tmp/kv"], "cache_dir", "/tmp/kv"),
    (["--cache-disk-bytes", "1048576"], "cache_disk_bytes", MiB),
    (["--warm-prompts", "w.json"], "warm_prompts", "w.json"),
    (["--context-length", "1024"], "context_length", 1024),
    (["--temp", "0.5"], "temperature", 0.5),
    (["--top-p", "0.9"], "top_p", 0.9),
    (["--top-k", "40"], "top_k", 40),
    (["--min-p", "0.05"], "min_p", 0.05),
    (["--max-tokens", "7"], "default_max_tokens", 7),
    (["--strip-attribution-header"], "strip_attribution_header", True),
    (["--keep-attribution-header"], "strip_attribution_header", False),
    (["--decode-gap", "0.5"], "decode_gap", 0.5),
    (["--draft-model", "d"], "draft_model", "d"),
    (["--num-draft-tokens", "5"], "num_draft_tokens", 5),
    (["--no-speculation"], "speculation", False),
    (["--no-cpu-fast-path"], "cpu_fast_path", False),
    (["--kv-bits", "8"], "kv_bits", 8),
    (["--kv-group-size", "32"], "kv_group_size", 32),
    (["--shard-timeout", "5"], "shard_timeout", 5.0),
    (["--pipeline"], "pipeline", True),
    (["--log-level", "debug"], "log_level", "debug"),
    (["--api-key", "a", "--api-key", "b"], "api_keys", ["a", "b"]),
    (["--admin-key", "k"], "admin_key", "k"),
    (["--cors-origin", "*"], "cors_origins", ["*"]),
    (["--no-ui"], "ui", False),
    (["--max-body-bytes", "1MiB"], "max_body_bytes", MiB),
    (["--max-messages", "3"], "max_messages", 3),
    (["--max-queue", "0"], "max_queue", 0),
    (["--request-timeout", "1.5"], "request_timeout", 1.5),
    (["--shutdown-grace", "2"], "shutdown_grace", 2.0),
    (["--max-connections", "5"], "max_connections", 5),
    (["--header-timeout", "1"], "header_timeout", 1.0),
    (["--write-timeout", "1"], "write_timeout", 1.0),
    (["--fetch-image-urls"], "fetch_image_urls", True),  # added with issue 60
]


def serve_flags(capsys) -> set[str]:
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--help"])
    return set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", capsys.readouterr().out))


def test_the_reference_in_the_docs_is_generated_from_the_settings():
    doc = DOC.read_text()
    assert with_reference(doc) == doc, "run `python -m mlx_cache_server.setting_flags`"


def test_serve_takes_the_flags_it_always_took(capsys):
    always = {argv[0] for argv, _, _ in FLAGS} | {"--help", "--config", "--model"}
    assert serve_flags(capsys) == always


@pytest.mark.parametrize("argv, name, value", FLAGS, ids=[f[0][0] for f in FLAGS])
def test_each_flag_sets_what_it_always_set(argv, name, value):
    settings = settings_of(_parser().parse_args(["serve", *argv]))
    assert getattr(settings, name) == value


def test_a_switch_left_out_keeps_the_sources_under_the_command_line(monkeypatch):
    monkeypatch.setenv("MLX_CACHE_SERVER_UI", "0")
    monkeypatch.setenv("MLX_CACHE_SERVER_SPECULATION", "no")
    settings = settings_of(_parser().parse_args(["serve"]))
    assert (settings.ui, settings.speculation, settings.cpu_fast_path) == (False, False, True)


def test_repeated_models_are_the_model_and_more_models(tmp_path):
    config = tmp_path / "s.toml"
    config.write_text('[[models]]\npath = "/m/file"\n')
    args = _parser().parse_args(["serve", "--config", str(config), "--model", "/m/a",
                                 "--model", "/m/b"])  # fmt: skip
    settings = settings_of(args)
    assert settings.model == "/m/a"
    assert settings.models == [{"path": "/m/file"}, {"path": "/m/b"}]


def test_the_docs_usage_names_only_flags_serve_takes(capsys):
    usage = DOC.read_text().split("```")[1].split("mlx-cache-server import-gguf")[0]
    assert set(re.findall(r"--[a-z][a-z-]*", usage)) <= serve_flags(capsys)


EXAMPLE = Path(__file__).parents[2] / "configs" / "server.example.toml"


def example_lines() -> tuple[list[str], list[str]]:
    """The example file's settings lines: those it sets, and those it shows commented out."""
    key = re.compile(r"^(#\s*)?([a-z_]+)\s*=")
    set_, shown = [], []
    for line in EXAMPLE.read_text().splitlines():
        if m := key.match(line):
            (shown if m.group(1) else set_).append(line)
    return set_, shown


def test_the_example_settings_file_names_real_settings_at_their_defaults(tmp_path):
    """The example is written by hand for its comments, so this keeps it from drifting from
    `Settings`: every key it sets or shows is a setting, and what it sets is the default."""
    set_, shown = example_lines()
    names = {re.match(r"#?\s*([a-z_]+)", line).group(1) for line in set_ + shown}
    assert names - set(Settings.model_fields) == set()
    config = tmp_path / "s.toml"
    for line in set_:
        config.write_text(line + "\n")
        name = line.split("=")[0].strip()
        assert getattr(load_settings(config, {}), name) == getattr(Settings(), name), line
    for line in shown:  # a commented-out value is one the setting takes
        config.write_text(line.lstrip("# ") + "\n")
        load_settings(config, {})


def test_the_example_check_finds_a_wrong_default(tmp_path, monkeypatch):
    wrong = tmp_path / "wrong.toml"
    wrong.write_text(EXAMPLE.read_text().replace("port = 8080", "port = 8081"))
    monkeypatch.setattr(sys.modules[__name__], "EXAMPLE", wrong)
    with pytest.raises(AssertionError, match="port = 8081"):
        test_the_example_settings_file_names_real_settings_at_their_defaults(tmp_path)
