"""The disk tier under PromptCache, on real mlx-lm layer caches with known contents."""

from __future__ import annotations

import os
import shutil
import stat
import threading

import pytest

from mlx_cache_server.prompt_cache import PackedTokens, PromptCache
from mlx_cache_server.prompt_cache.disk import HEADER_SLACK, DiskTier, DiskTierBusy
from tests.fakes import BYTES_PER_TOKEN, kv_cache, same_state

SYSTEM = list(range(100, 400))


def tiered(tmp_path, ram_bytes=None, disk_bytes=1 << 30, fingerprint="fp"):
    return PromptCache(64, ram_bytes, disk=DiskTier(tmp_path, fingerprint, disk_bytes))


def test_a_sequence_evicted_from_ram_comes_back_from_disk(tmp_path):
    cache = tiered(tmp_path, ram_bytes=350 * BYTES_PER_TOKEN)
    a, b = SYSTEM + [1, 2, 3], list(range(1000, 1300))
    cache.insert("m", a, kv_cache(a))
    cache.disk.flush()
    cache.insert("m", b, kv_cache(b))  # a loses RAM: both do not fit
    cache.disk.flush()
    _, in_ram = cache.peek("m", a + [9])
    assert in_ram < len(a) - 16
    found = cache.fetch("m", a + [9])
    assert found.n_cached == len(a) and same_state(found.cache, kv_cache(a))
    stats = cache.stats("m")
    assert stats.disk_hits == 1 and stats.tokens_from_disk == len(a) - in_ram


def test_a_shared_prefix_is_written_once(tmp_path):
    cache = tiered(tmp_path)
    for tail in ([1, 2], [3, 4], [5, 6]):
        cache.insert("m", SYSTEM + tail, kv_cache(SYSTEM + tail))
    cache.disk.flush()
    written = cache.disk.stats.bytes_written
    data = (len(SYSTEM) + 6) * BYTES_PER_TOKEN
    assert data <= written <= data + 4 * HEADER_SLACK
    assert cache.disk.nbytes == written


def test_restart_restores_the_index_and_branches(tmp_path):
    cache = tiered(tmp_path)
    turn1 = SYSTEM + [1, 2, 3]
    turn2 = turn1 + [4, 5, 6, 7]
    other = SYSTEM[:150] + [8] * 20  # branches inside the first file
    for seq in (turn1, turn2, other):
        cache.insert("m", seq, kv_cache(seq))
    cache.disk.close()
    again = tiered(tmp_path)
    for seq in (turn2, other):
        found = again.fetch("m", seq + [0])
        assert found.n_cached == len(seq) and same_state(found.cache, kv_cache(seq))
    assert again.stats("m").disk_hits == 2


def test_another_fingerprint_or_namespace_never_sees_the_files(tmp_path):
    cache = tiered(tmp_path)
    cache.insert("m", SYSTEM, kv_cache(SYSTEM))
    cache.insert(("m", "tenant-a"), SYSTEM, kv_cache(SYSTEM))
    cache.disk.close()
    assert tiered(tmp_path, fingerprint="other").fetch("m", SYSTEM).kind == "miss"
    again = tiered(tmp_path)
    assert again.fetch(("m", "tenant-b"), SYSTEM).kind == "miss"
    assert again.fetch(("m", "tenant-a"), SYSTEM).n_cached == len(SYSTEM) - 1


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "delete"])
def test_a_damaged_file_is_dropped_and_recomputed_never_served(tmp_path, damage):
    cache = tiered(tmp_path)
    seq = SYSTEM + [1, 2]
    cache.insert("m", seq, kv_cache(seq))
    cache.disk.close()
    (path,) = [p for p in cache.disk.folder.iterdir() if p.suffix == ".safetensors"]
    if damage == "corrupt":
        data = bytearray(path.read_bytes())
        data[-5] ^= 0xFF  # one value's byte: the file still parses
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[:-100])
    else:
        path.unlink()
    again = tiered(tmp_path)
    assert again.fetch("m", seq).kind == "miss"
    assert again.disk.stats.dropped == 1 and again.disk.nbytes == 0
    assert not [p for p in again.disk.folder.iterdir() if p.suffix == ".safetensors"]
    again.insert("m", seq, kv_cache(seq))  # recomputed, stored again
    again.disk.flush()
    assert again.disk.stats.writes == 1


def test_the_disk_budget_is_never_exceeded(tmp_path):
    one = (len(SYSTEM) + 2) * BYTES_PER_TOKEN
    cache = tiered(tmp_path, disk_bytes=2 * one + 4096)  # two files and their headers
    seqs = [[t] * 2 + SYSTEM for t in range(5)]  # nothing shared
    for seq in seqs:
        cache.insert("m", seq, kv_cache(seq))
        cache.disk.flush()
        assert cache.disk.nbytes <= 2 * one + 4096
    on_disk = sum(
        p.stat().st_size for p in cache.disk.folder.iterdir() if p.suffix == ".safetensors"
    )
    assert on_disk == cache.disk.nbytes and cache.disk.stats.evicted == 3
    cache.clear("m")  # RAM and disk: the oldest on disk went first
    assert cache.disk.nbytes == 0


def test_files_are_the_owners_alone(tmp_path):
    cache = tiered(tmp_path)
    cache.insert("m", SYSTEM, kv_cache(SYSTEM))
    cache.disk.flush()
    assert stat.S_IMODE(os.stat(cache.disk.folder).st_mode) == 0o700
    for path in cache.disk.folder.iterdir():
        if path.suffix == ".safetensors":
            assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_concurrent_fetches_of_one_disk_segment_each_get_it_whole(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    cache = tiered(tmp_path)
    seq = SYSTEM + [1, 2, 3]
    cache.insert("m", seq, kv_cache(seq))
    cache.disk.close()
    again = tiered(tmp_path)
    with ThreadPoolExecutor(4) as pool:
        found = list(pool.map(lambda _: again.fetch("m", seq + [7]), range(4)))
    assert all(f.n_cached == len(seq) and same_state(f.cache, kv_cache(seq)) for f in found)
    assert again.stats("m").sequences == 1 and again.stats("m").bytes == len(seq) * BYTES_PER_TOKEN


def test_clear_wins_over_writes_queued_before_it(tmp_path):
    cache = tiered(tmp_path)
    gate, write = threading.Event(), cache.disk._writer._write

    def held(*job):
        gate.wait()
        write(*job)

    cache.disk._writer._write = held  # the writer waits: every insert's write is still queued
    for t in range(5):
        seq = [t] + SYSTEM
        cache.insert("m", seq, kv_cache(seq))
    cache.clear("m")
    gate.set()
    cache.disk.close()
    again = tiered(tmp_path)
    assert again.disk.nbytes == 0 and again.fetch("m", [0] + SYSTEM).kind == "miss"


def test_eviction_takes_a_path_from_its_end(tmp_path):
    turn1 = SYSTEM + [1]
    turn2 = turn1 + list(range(10))
    cache = tiered(tmp_path)
    for seq in (turn1, turn2):
        cache.insert("m", seq, kv_cache(seq))
        cache.disk.flush()
    other = [7] * 12
    # One byte short of room for `other` (its arrays and header bound): a file must go.
    cache.disk.max_bytes = cache.disk.nbytes + 12 * BYTES_PER_TOKEN + HEADER_SLACK + 4 * 128 - 1
    cache.insert("m", other, kv_cache(other))
    cache.disk.flush()
    assert cache.disk.stats.evicted == 1 and cache.disk.stats.writes == 3
    assert cache.disk.match("m", PackedTokens.of(turn2)) == len(turn1)


def test_a_prefix_the_disk_lost_is_written_again_with_the_next_turn(tmp_path):
    cache = tiered(tmp_path)
    turn1 = SYSTEM + [1, 2]
    cache.insert("m", turn1, kv_cache(turn1))
    cache.disk.flush()
    cache.disk.clear("m")  # the disk loses it; RAM still holds it
    turn2 = turn1 + [3, 4]
    cache.insert("m", turn2, kv_cache(turn2))
    cache.disk.flush()
    assert cache.disk.match("m", PackedTokens.of(turn2)) == len(turn2)


def test_a_failed_write_gives_its_room_back(tmp_path):
    cache = tiered(tmp_path)
    shutil.rmtree(cache.disk.folder)  # the folder is gone: every write fails
    cache.insert("m", SYSTEM, kv_cache(SYSTEM))
    cache.disk.flush()
    assert cache.disk.nbytes == 0 and cache.disk.stats.skipped == 1


def test_one_process_per_folder_and_a_smaller_budget_on_restart(tmp_path):
    cache = tiered(tmp_path)
    with pytest.raises(DiskTierBusy):
        tiered(tmp_path)
    for t in range(3):
        seq = [t] + SYSTEM
        cache.insert("m", seq, kv_cache(seq))
    cache.disk.close()
    one = (len(SYSTEM) + 1) * BYTES_PER_TOKEN
    again = tiered(tmp_path, disk_bytes=one + 2000)
    assert again.disk.nbytes <= one + 2000 and again.disk.stats.files == 1


LOADS_BESIDE_CLEAR_CACHE = """
import sys, tempfile, threading
import mlx.core as mx
sys.path.insert(0, sys.argv[1])
from mlx_cache_server.prompt_cache import PackedTokens, PromptCache
from mlx_cache_server.prompt_cache.disk import DiskTier
from tests.fakes import kv_cache
seq = list(range(100, 400))
root = tempfile.mkdtemp()
cache = PromptCache(64, None, disk=DiskTier(root, "fp", 1 << 30))
cache.insert("m", seq, kv_cache(seq))
cache.disk.close()
disk = DiskTier(root, "fp", 1 << 30)
done = threading.Event()
def loads():
    for _ in range(200):
        assert disk.load("m", PackedTokens.of(seq), 0, len(seq)) is not None
    done.set()
threading.Thread(target=loads, daemon=True).start()
while not done.is_set():
    mx.clear_cache()  # what the engine thread does when it releases memory
print("ok")
"""


def test_a_load_beside_the_engine_releasing_memory_never_deadlocks(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "loads.py"
    script.write_text(LOADS_BESIDE_CLEAR_CACHE)
    root = str(Path(__file__).resolve().parents[2])
    done = subprocess.run(
        [sys.executable, str(script), root], capture_output=True, text=True, timeout=120
    )
    assert done.stdout.strip() == "ok", done.stderr[-2000:]


def test_half_precision_segments_round_trip(tmp_path):
    import mlx.core as mx

    seq = SYSTEM + [1, 2]
    kv = kv_cache(seq)
    for layer in kv:
        layer.keys, layer.values = layer.keys.astype(mx.bfloat16), layer.values.astype(mx.bfloat16)
    cache = tiered(tmp_path)
    cache.insert("m", seq, kv)
    cache.disk.close()
    found = tiered(tmp_path).fetch("m", seq + [0])
    assert found.n_cached == len(seq) and found.cache[0].keys.dtype == mx.bfloat16
    for got, want in zip(found.cache, kv, strict=True):  # numpy has no bfloat16: compare wider
        for a, b in ((got.keys, want.keys), (got.values, want.values)):
            assert mx.array_equal(a[..., : len(seq), :].astype(mx.float32),
                                  b[..., : len(seq), :].astype(mx.float32)).item()  # fmt: skip


def test_other_fingerprints_unused_for_a_week_are_removed_unless_held(tmp_path):
    week_ago = os.stat(tmp_path).st_mtime - 8 * 24 * 3600
    folders = {}
    for name in ("old", "recent", "held"):
        tier = DiskTier(tmp_path, name, 1 << 20)
        tier.close()
        folders[name] = tmp_path / name
    (tmp_path / "notes").mkdir()  # not a disk tier's folder: never touched
    held = DiskTier(tmp_path, "held", 1 << 20)  # another server, using its folder now
    for name in ("old", "held"):
        os.utime(folders[name] / "index.sqlite", (week_ago, week_ago))
    try:
        tier = DiskTier(tmp_path, "mine", 1 << 20)
        tier.close()
    finally:
        held.close()
    assert tier.removed_stale == [folders["old"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["held", "mine", "notes", "recent"]


def test_a_write_starting_inside_a_ram_segment_reaches_the_disk(tmp_path):
    """The disk holds more of a path than RAM's segment begins with: the write is a slice
    of that segment, a strided view, which must be written and checksummed whole."""
    cache = tiered(tmp_path, ram_bytes=320 * BYTES_PER_TOKEN)
    a, b = SYSTEM + [1, 2], list(range(1000, 1300))
    cache.insert("m", a, kv_cache(a))
    cache.insert("m", b, kv_cache(b))  # RAM drops a: the disk keeps it
    cache.disk.flush()
    c = a[:200] + [7] * 50  # RAM stores c as one segment [0, 250); the disk has [0, 200)
    cache.insert("m", c, kv_cache(c))
    cache.disk.flush()
    assert cache.disk.stats.skipped == 0 and cache.disk.stats.writes == 3
    cache.disk.close()
    again = tiered(tmp_path)
    found = again.fetch("m", c + [0])
    assert found.n_cached == len(c) and same_state(found.cache, kv_cache(c))


def _lose_file_of(cache, tokens):
    """Delete the file holding the first token of `tokens`' path, after a clean close."""
    cache.disk.close()
    rows = cache.disk.folder / "index.sqlite"
    import sqlite3

    db = sqlite3.connect(rows)
    (name,) = db.execute("SELECT name FROM files WHERE start = 0").fetchone()
    db.close()
    (cache.disk.folder / f"{name}.safetensors").unlink()


def test_a_lost_parent_file_keeps_the_files_below_it_until_a_request_refills_it(tmp_path, caplog):
    turn1 = SYSTEM + [1, 2]
    turn2 = turn1 + list(range(3, 23))
    other = SYSTEM + [9] * 20  # branches inside turn1's file
    cache = tiered(tmp_path)
    for seq in (turn1, turn2, other):
        cache.insert("m", seq, kv_cache(seq))
    cache.disk.flush()
    assert cache.disk.stats.files == 3
    _lose_file_of(cache, turn1)
    with caplog.at_level("WARNING", logger="mlx_cache_server.prompt_cache.disk"):
        again = tiered(tmp_path)
    (line,) = [r.getMessage() for r in caplog.records if "files restored" in r.getMessage()]
    assert "2 files restored, 1 dropped (its file is missing: 1)" in line
    assert "2 kept behind a lost file" in line
    assert again.disk.stats.dropped == 1 and again.disk.stats.files == 2
    for seq in (turn2, other):  # nothing past the gap is served
        assert again.disk.match("m", PackedTokens.of(seq)) == 0
        assert again.fetch("m", seq).kind == "miss"
    again.insert("m", turn1, kv_cache(turn1))  # the next request through it is stored
    again.disk.flush()
    assert again.disk.stats.skipped == 0
    for seq in (turn2, other):
        assert again.disk.match("m", PackedTokens.of(seq)) == len(seq)
    again.disk.close()
    third = tiered(tmp_path)
    assert third.disk.stats.dropped == 0
    for seq in (turn2, other):
        found = third.fetch("m", seq + [0])
        assert found.n_cached == len(seq) and same_state(found.cache, kv_cache(seq))


def test_a_file_found_corrupt_on_load_keeps_the_files_below_it(tmp_path):
    turn1 = SYSTEM + [1, 2]
    turn2 = turn1 + list(range(3, 23))
    cache = tiered(tmp_path)
    for seq in (turn1, turn2):
        cache.insert("m", seq, kv_cache(seq))
    cache.disk.close()
    again = tiered(tmp_path)
    first = min(again.disk._space.lru, key=lambda f: f.start)
    path = again.disk.folder / f"{first.name}.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    assert again.fetch("m", turn2 + [0]).kind == "miss"  # the corrupt file is never served
    assert again.disk.stats.dropped == 1 and again.disk.stats.files == 1
    again.insert("m", turn1, kv_cache(turn1))
    again.disk.flush()
    found = again.fetch("m", turn2 + [0])
    assert found.n_cached == len(turn2) and same_state(found.cache, kv_cache(turn2))


def test_an_unwritable_folder_is_one_clear_error(tmp_path):
    from mlx_cache_server.prompt_cache.disk import DiskTierUnavailable

    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(DiskTierUnavailable, match="cannot write to"):
        DiskTier(tmp_path / "file", "fp", 1 << 20)


def test_a_read_only_folder_is_one_clear_error(tmp_path):
    import subprocess

    from mlx_cache_server.prompt_cache.disk import DiskTierUnavailable

    cache = tiered(tmp_path / "src")
    cache.insert("m", SYSTEM, kv_cache(SYSTEM))
    cache.disk.close()
    ro = tmp_path / "ro"
    ro.mkdir()
    bind = subprocess.run(["mount", "--bind", "-o", "ro", str(tmp_path / "src"), str(ro)],
                          capture_output=True)  # fmt: skip
    if bind.returncode != 0:
        pytest.skip(f"cannot make a read-only mount here: {bind.stderr.decode().strip()}")
    try:
        with pytest.raises(DiskTierUnavailable, match="Read-only file system"):
            DiskTier(ro, "fp", 1 << 30)
    finally:
        subprocess.run(["umount", str(ro)], check=True)
