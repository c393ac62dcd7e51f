"""Images in the cache's other places: the disk tier keeps an image's KV across a restart
under the same ids (and a different image still never matches), and the cache page shows
an image as a marker, not as its ids."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.test_vision import BEFORE_IMAGE, ask, image, png, text
from tests.live import serving
from tests.vision_models import build_gemma3_vision


@pytest.fixture(scope="module")
def attention_only(tmp_path_factory):
    """Every layer global: a model whose cache the disk tier keeps."""
    folder = tmp_path_factory.mktemp("gemma3_global")
    return str(build_gemma3_vision(folder, sliding_window_pattern=1))


def test_a_restarted_server_serves_an_image_from_the_disk_tier(attention_only, tmp_path):
    kv = str(tmp_path / "kv")
    url = png(11)
    first = [{"role": "user", "content": [image(url), text("What is shown here?")]}]
    with serving(attention_only, cache_dir=kv, speculation=False) as server:
        reply, usage = ask(server, first)
        assert server.engine.cache_mode == "prefix"
    other = [{"role": "user", "content": [image(png(12)), text("What is shown here?")]}]
    with serving(attention_only, cache_dir=kv, speculation=False) as server:
        # First after the restart: a server that forgot which ids it gave would give this
        # image the first image's, and match its KV on disk.
        other_reply, usage_other = ask(server, other)
        assert usage_other.prompt_tokens_details.cached_tokens <= BEFORE_IMAGE
        again, usage_again = ask(server, first)
        assert again == reply
        assert usage_again.prompt_tokens_details.cached_tokens >= usage.prompt_tokens - 8
    with serving(attention_only, no_cache=True, speculation=False) as server:
        assert ask(server, other)[0] == other_reply


def test_the_cache_page_shows_an_image_as_a_marker(attention_only):
    with serving(attention_only, speculation=False) as server:
        ask(server, [{"role": "user", "content": [text("See: "), image(png(13))]}])
        report = httpx.get(server.url + "/v1/cache/tree").json()
    texts = [b["text"] for ns in report["namespaces"] for b in ns["branches"]]
    assert any("See: \n\n<start_of_image>[image]<end_of_image>" in t for t in texts), texts


def test_kept_image_features_come_out_of_the_caches_budget(attention_only):
    budget = 64 * 1024**2
    with serving(attention_only, cache_max_bytes=budget, speculation=False) as server:
        engine = server.engine
        assert engine.vision.features.budget == budget // 4
        assert engine.cache.max_bytes + engine.vision.features.budget == budget


def test_an_unbounded_cache_stays_unbounded_beside_the_features(attention_only):
    from mlx_cache_server.models.vision_load import FEATURE_BYTES

    with serving(attention_only, cache_max_bytes=None, speculation=False) as server:
        assert server.engine.cache.byte_budget is None
        assert server.engine.vision.features.budget == FEATURE_BYTES
