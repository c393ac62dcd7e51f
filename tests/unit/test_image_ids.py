"""Image ids: the same pixels get the same ids, other pixels other ids, and a released
image's ids are never handed out again (a cached sequence holding them must never match
another image)."""

from __future__ import annotations

import numpy as np
import pytest

from mlx_cache_server.models.vision import IMAGE_BASE, ImageIds


def pixels(seed: int) -> np.ndarray:
    return np.random.RandomState(seed).rand(1, 3, 8, 8).astype(np.float32)


def test_the_same_pixels_get_the_same_ids_and_others_new_ones():
    ids = ImageIds()
    a, b = ids.register(pixels(0), 4), ids.register(pixels(1), 4)
    assert ids.register(pixels(0).copy(), 4) is a
    assert (a.first, b.first) == (IMAGE_BASE, IMAGE_BASE + 4)
    assert ids.of(a.first + 3) is a and ids.of(b.first) is b
    assert ids.of(b.first + 4) is None  # past the last image's ids


def test_a_change_of_one_value_or_of_the_layout_is_another_image():
    ids = ImageIds()
    base = ids.register(pixels(0), 4)
    changed = pixels(0)
    changed[0, 0, 0, 0] += 1e-6
    assert ids.register(changed, 4) is not base
    assert ids.register(pixels(0).reshape(1, 3, 4, 16), 4) is not base


def test_released_ids_are_never_reused():
    ids = ImageIds(max_images=2)
    first = ids.register(pixels(0), 4)
    ids.register(pixels(1), 4)
    ids.register(pixels(2), 4)  # releases the first
    assert ids.of(first.first) is None
    again = ids.register(pixels(0), 4)  # the same pixels: new ids, the old stay retired
    assert again.first >= first.first + 12


def test_the_ids_run_out_rather_than_wrap():
    ids = ImageIds()
    with pytest.raises(ValueError, match="every image id"):
        ids.register(pixels(0), 1 << 31)


def test_a_recorded_server_gives_the_same_pixels_the_same_ids_after_a_restart(tmp_path):
    record = tmp_path / "image-ids"
    before = ImageIds()
    before.keep_in(record)
    a = before.register(pixels(0), 4)
    b = before.register(pixels(1), 4)
    after = ImageIds()
    after.keep_in(record)
    assert after.of(a.first) is None  # recalled, but its pixels are not here to encode
    assert after.register(pixels(0), 4).first == a.first
    assert after.register(pixels(1), 4).first == b.first
    assert after.register(pixels(2), 4).first >= b.first + 4  # never one handed out before


def test_after_a_crash_no_id_is_handed_out_again(tmp_path):
    """Images registered after the record's last image line (lost in a crash) had their
    ids reserved first, so a restarted server starts past them."""
    record = tmp_path / "image-ids"
    before = ImageIds()
    before.keep_in(record)
    used = [before.register(pixels(i), 4) for i in range(3)]
    lines = record.read_text().splitlines()
    record.write_text("\n".join(x for x in lines if x.startswith("reserve")) + "\nimage 12")
    after = ImageIds()
    after.keep_in(record)
    fresh = after.register(pixels(9), 4)
    assert fresh.first >= used[-1].first + 4
