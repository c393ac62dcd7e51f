"""Image ids: the same pixels get the same ids, other pixels other ids, and a released
image's ids are never handed out again (a cached sequence holding them must never match
another image)."""

from __future__ import annotations

import numpy as np
import pytest

from mlx_cache_server.models.vision import IMAGE_BASE, Holds, ImageIds


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
    ids.release([first, ids.register(pixels(1), 4), ids.register(pixels(2), 4)])
    assert ids.of(first.first) is None  # the least recent one no request holds: forgotten
    again = ids.register(pixels(0), 4)  # the same pixels: new ids, the old stay retired
    assert again.first >= first.first + 12


def test_an_image_a_request_holds_is_never_forgotten_and_keeps_its_pixels():
    """One request with more images than the server remembers: each stays until it ends."""
    ids = ImageIds(max_images=2)
    held = [ids.register(pixels(i), 4) for i in range(5)]
    assert all(ids.of(image.first) is image and image.pixels is not None for image in held)
    ids.release(held[:4])
    assert [ids.of(image.first) for image in held[:3]] == [None, None, None]
    assert ids.of(held[3].first) is held[3] and held[3].pixels is None  # remembered, no pixels
    assert held[4].pixels is not None  # still held
    again = ids.register(pixels(3), 4)  # a new request brings its pixels back
    assert again is held[3] and again.pixels is not None


def test_holds_released_once_and_a_late_image_at_once():
    ids = ImageIds(max_images=0)
    holds = Holds(ids)
    holds.append(ids.register(pixels(0), 4))
    holds.release()
    holds.release()  # once: a second release releases nothing twice
    late = ids.register(pixels(1), 4)
    holds.append(late)  # registered after its request ended: released at once
    assert late.holds == 0 and len(ids) == 0


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
    assert after.of(a.first).pixels is None  # recalled, but its pixels are not here
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
