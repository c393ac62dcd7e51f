import pytest

from mlx_cache_server.settings import (
    FALLBACK_CACHE_BYTES,
    Settings,
    default_cache_bytes,
    describe_size,
    load_settings,
    parse_size,
)


def test_sizes():
    assert parse_size("512MiB") == 512 * 1024**2
    assert parse_size("2GB") == 2 * 10**9
    assert parse_size("1.5g") == 1_500_000_000
    assert parse_size(1234) == 1234
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")
    assert describe_size(None) == "no byte budget" and describe_size(3 * 1024**3) == "3.0 GiB"


def test_flags_beat_environment_beat_file(tmp_path, monkeypatch):
    config = tmp_path / "s.toml"
    config.write_text('port = 1111\ncache_max_bytes = "1MiB"\nhost = "0.0.0.0"\n')
    monkeypatch.setenv("MLX_CACHE_SERVER_PORT", "2222")
    monkeypatch.setenv("MLX_CACHE_SERVER_NO_CACHE", "true")
    s = load_settings(config, {"host": "127.0.0.2", "port": None})
    assert (s.port, s.host, s.cache_max_bytes, s.no_cache) == (2222, "127.0.0.2", 1024**2, True)
    s = load_settings(config, {"port": 3333})
    assert s.port == 3333


def test_unknown_setting_is_refused(tmp_path):
    config = tmp_path / "s.toml"
    config.write_text("prot = 1\n")
    with pytest.raises(ValueError, match="unknown settings .*prot"):
        load_settings(config, {})


@pytest.mark.parametrize("gap", ["0", "-1", "inf", "nan"])
def test_a_decode_gap_must_be_a_positive_number_of_seconds(gap):
    with pytest.raises(ValueError, match="decode_gap"):
        load_settings(None, {"decode_gap": gap})


def test_the_ram_cache_has_a_byte_budget_that_fits_the_machine_by_default():
    gib = 1024**3
    assert default_cache_bytes(None, 16 * gib) == (
        2 * gib,
        "an eighth of the 16.0 GiB of memory here",
    )
    assert default_cache_bytes(8 * gib, 64 * gib)[0] == 2 * gib  # the models' budget counts it
    assert default_cache_bytes(None, None) == (
        FALLBACK_CACHE_BYTES,
        "the machine's memory is unknown",
    )


def test_a_model_without_a_cache_budget_gets_the_default_and_a_set_one_wins(monkeypatch):
    from mlx_cache_server.models.loader import ModelLoader
    from mlx_cache_server.models.specs import ModelSpec
    from mlx_cache_server.runtime import memory

    monkeypatch.setattr(memory, "machine_memory", lambda: 32 * 1024**3)
    spec = ModelSpec("m", "/models/m")
    loader = ModelLoader(Settings(), serve=None)
    assert loader.settings_of(spec).cache_max_bytes == 4 * 1024**3
    assert "an eighth of the 32.0 GiB" in loader._cache_budget_origin(spec)
    loader = ModelLoader(Settings(cache_max_bytes=1 << 20), serve=None)
    assert loader.settings_of(spec).cache_max_bytes == 1 << 20
    assert loader._cache_budget_origin(spec) is None


def test_a_containers_memory_limit_counts_as_the_machines(monkeypatch, tmp_path):
    from mlx_cache_server.runtime import memory

    unlimited, limited = tmp_path / "memory.max", tmp_path / "limit_in_bytes"
    unlimited.write_text("max\n")
    limited.write_text(f"{1 << 30}\n")
    monkeypatch.setattr(memory, "CGROUP_LIMITS", (str(unlimited), str(tmp_path / "none")))
    assert memory.machine_memory.__wrapped__() > 1 << 20  # the machine's RAM
    monkeypatch.setattr(memory, "CGROUP_LIMITS", (str(unlimited), str(limited)))
    assert memory.machine_memory.__wrapped__() == 1 << 30
