"""The disk tier serves a file only as what was written: its header, its arrays and the
index row that says which tokens and tenant it is for are all under its checksum."""

from __future__ import annotations

import json
import random
import shutil
import sqlite3

import pytest

from mlx_cache_server.prompt_cache import PackedTokens, PromptCache
from mlx_cache_server.prompt_cache.disk import DiskTier
from mlx_cache_server.prompt_cache.disk_space import namespace_of
from tests.fakes import kv_cache, same_state

SEQ = list(range(100, 400)) + [1, 2]
OTHER = list(range(1000, 1302))  # as long as SEQ, sharing nothing with it


def tiered(root):
    return PromptCache(64, None, disk=DiskTier(root, "fp", 1 << 30))


def stored(root, model="m", seq=SEQ):
    """A closed tier under `root` holding one file: `seq`'s KV."""
    cache = tiered(root)
    cache.insert(model, seq, kv_cache(seq))
    cache.disk.close()
    (path,) = [p for p in (root / "fp").iterdir() if p.suffix == ".safetensors"]
    return path


def header_of(path):
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return data, n


def edit_header(path, old: bytes, new: bytes):
    """Replace the first `old` in the file's header by `new`, of the same size."""
    assert len(old) == len(new)
    data, n = header_of(path)
    at = data.index(old, 8, 8 + n)
    path.write_bytes(data[:at] + new + data[at + len(old) :])


def assert_a_clean_miss(root, model="m", seq=SEQ):
    """A fetch of `seq` finds nothing, raises nothing, and the file and its row are gone."""
    again = tiered(root)
    assert again.fetch(model, seq + [0]).kind == "miss"
    assert again.disk.stats.dropped == 1 and again.disk.stats.files == 0
    assert not [p for p in again.disk.folder.iterdir() if p.suffix == ".safetensors"]
    db = sqlite3.connect(again.disk.folder / "index.sqlite")
    assert db.execute("SELECT COUNT(*) FROM files").fetchone() == (0,)
    db.close()
    again.insert(model, seq, kv_cache(seq))  # recomputed and stored again, then served
    again.disk.close()
    found = tiered(root).fetch(model, seq + [0])
    assert found.n_cached == len(seq) and same_state(found.cache, kv_cache(seq))


@pytest.mark.parametrize("edit", ["dtype", "shape", "name"])
def test_a_same_size_header_edit_is_a_miss_that_drops_the_file(tmp_path, edit):
    path = stored(tmp_path)
    if edit == "dtype":
        edit_header(path, b'"F32"', b'"I32"')  # the fakes' KV is float32
    elif edit == "shape":
        data, n = header_of(path)
        shape = json.loads(data[8 : 8 + n])["0.0"]["shape"]  # (1, heads, tokens, head_dim)
        assert shape[1] != shape[3]
        swapped = [shape[0], shape[3], shape[2], shape[1]]
        edit_header(path, json.dumps(shape).replace(" ", "").encode(),
                    json.dumps(swapped).replace(" ", "").encode())  # fmt: skip
    else:
        edit_header(path, b'"1.1"', b'"9.1"')  # the arrays' order by name is unchanged
    assert_a_clean_miss(tmp_path)


@pytest.mark.parametrize("column", ["tokens", "namespace"])
def test_a_rewritten_index_row_is_a_miss_that_drops_the_file(tmp_path, column):
    """A row rewritten to say its file holds other tokens, or another tenant's, is not
    served as those: the row is bound to the file by its checksum."""
    model, seq = ("m", "tenant-a"), SEQ
    stored(tmp_path, model)
    other_model, other_seq = model, OTHER
    db = sqlite3.connect(tmp_path / "fp" / "index.sqlite")
    if column == "tokens":
        db.execute("UPDATE files SET tokens = ?", (bytes(PackedTokens.of(OTHER)),))
    else:
        other_model, other_seq = ("m", "tenant-b"), seq
        db.execute("UPDATE files SET namespace = ?", (namespace_of(other_model),))
    db.commit()
    db.close()
    assert_a_clean_miss(tmp_path, other_model, other_seq)


def test_random_bit_flips_in_a_header_are_only_ever_clean_misses(tmp_path):
    pristine = tmp_path / "pristine"
    path = stored(pristine)
    data, n = header_of(path)
    rng = random.Random(55)
    for i in range(1000):
        root = tmp_path / str(i)
        shutil.copytree(pristine, root)
        flipped = bytearray(data)
        bit = rng.randrange(8 * (8 + n))
        flipped[bit // 8] ^= 1 << (bit % 8)
        (root / "fp" / path.name).write_bytes(bytes(flipped))
        cache = tiered(root)
        assert cache.fetch("m", SEQ + [0]).kind == "miss", f"bit {bit} was served"
        assert cache.disk.stats.dropped == 1 and cache.disk.stats.files == 0, f"bit {bit}"
        cache.disk.close()
        shutil.rmtree(root)
