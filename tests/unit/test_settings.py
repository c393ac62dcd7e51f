import pytest

from app.settings import describe_size, load_settings, parse_size


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
