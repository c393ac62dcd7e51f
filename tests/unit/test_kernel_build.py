"""What the kernels' build does when the compiler or the cache folder misbehaves: a start
goes on without the kernels (`native.problem` says why), and only a library that is ours
and whole is handed out to be loaded or preloaded. A stub compiler stands in for `cc`."""

from __future__ import annotations

import errno
import os
import stat
import sys
import time
from pathlib import Path

import pytest

from mlx_cache_server.runtime import blas, kernel_cache, native

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="built on Linux")

STUB = """#!/bin/sh
# A compiler that writes some bytes where `-o` says, and counts its builds.
if [ "$1" = --version ]; then echo "stub 1.0"; exit 0; fi
echo built >> "{calls}"
{body}
while [ $# -gt 0 ]; do
  if [ "$1" = -o ]; then head -c 20000 /dev/urandom > "$2"; fi
  shift
done
"""


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache home of the test's own, kernels allowed."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(native.DISABLE, raising=False)
    return tmp_path / "cache"


def stub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str = "") -> Path:
    """Put a stub compiler in CC; the file its builds are counted in."""
    calls = tmp_path / "calls"
    path = tmp_path / "stub-cc"
    path.write_text(STUB.format(calls=calls, body=body))
    path.chmod(0o755)
    monkeypatch.setenv("CC", str(path))
    return calls


def builds(calls: Path) -> int:
    return len(calls.read_text().splitlines()) if calls.exists() else 0


def test_a_build_is_published_private_with_its_digest(home, tmp_path, monkeypatch):
    calls = stub(tmp_path, monkeypatch)
    lib = native.library()
    assert lib is not None and native.problem is None and lib.is_relative_to(home)
    assert kernel_cache.matches(lib)
    for folder in (lib.parent, lib.parent.parent, lib.parent.parent.parent):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    digest = lib.with_name(lib.name + kernel_cache.DIGEST)
    assert stat.S_IMODE(digest.stat().st_mode) == 0o600
    assert native.library() == lib and builds(calls) == 1  # found, not built again
    assert not [p for p in lib.parent.parent.iterdir() if p.name.startswith(".")]  # no leftovers


def test_a_truncated_library_is_never_preloaded_and_is_built_again(home, tmp_path, monkeypatch):
    calls = stub(tmp_path, monkeypatch)
    lib = native.library()
    whole = lib.read_bytes()
    lib.write_bytes(whole[:4096])  # as a full disk or a killed copy leaves it
    assert not kernel_cache.matches(lib)
    again = native.library()
    assert again == lib and builds(calls) == 2 and kernel_cache.matches(again)
    assert again.stat().st_size == len(whole)


def test_a_library_that_fails_its_digest_is_not_preloaded(home, tmp_path, monkeypatch):
    stub(tmp_path, monkeypatch)
    lib = native.library()
    lib.write_bytes(b"\x7fELF planted" + lib.read_bytes()[12:])  # same size, other bytes
    stub(tmp_path, monkeypatch, body="exit 1")  # and no compiler that works now
    assert native.library() is None and "failed" in native.problem
    if blas.find_openblas() is not None:
        assert blas.preload() == [blas.find_openblas()]  # OpenBLAS alone
    assert not lib.exists()  # the bad folder is gone, not loaded


def test_a_folder_others_may_write_is_refused(home, tmp_path, monkeypatch):
    calls = stub(tmp_path, monkeypatch)
    lib = native.library()
    kernels = lib.parent.parent
    kernels.chmod(0o777)
    assert native.library() is None and "open to other users" in native.problem
    kernels.chmod(0o700)
    lib.parent.chmod(0o775)
    assert native.library() is None and "open to other users" in native.problem
    lib.parent.chmod(0o700)
    lib.chmod(0o777)  # the library itself: not ours alone, so not whole either
    assert native.library() == lib and builds(calls) == 2  # discarded, built again
    assert stat.S_IMODE(lib.stat().st_mode) & 0o022 == 0


@pytest.mark.skipif(os.getuid() != 0, reason="handing a folder to another user needs root")
def test_a_folder_of_another_user_is_refused(home, tmp_path, monkeypatch):
    stub(tmp_path, monkeypatch)
    lib = native.library()
    os.chown(lib.parent, 4242, -1)
    assert native.library() is None and "another user" in native.problem
    os.chown(lib.parent, 0, -1)
    os.chown(lib, 4242, -1)  # a library planted by someone else, digest and all
    assert native.library() == lib and lib.stat().st_uid == 0  # built again, ours


def test_a_cache_home_that_cannot_be_written_leaves_the_kernels_out(tmp_path, monkeypatch):
    stub(tmp_path, monkeypatch)
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker / "cache"))
    monkeypatch.delenv(native.DISABLE, raising=False)
    assert native.library() is None and "kernel cache" in native.problem
    assert native._load_layers() is None and "kernel cache" in native.layers_problem
    if os.getuid() != 0:  # a read-only home (root writes it anyway)
        home = tmp_path / "home"
        home.mkdir(mode=0o500)
        monkeypatch.setenv("XDG_CACHE_HOME", str(home))
        assert native.library() is None and "kernel cache" in native.problem


def test_a_full_disk_while_publishing_leaves_the_kernels_out(home, tmp_path, monkeypatch):
    stub(tmp_path, monkeypatch)

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device", str(home))

    monkeypatch.setattr(kernel_cache, "publish", full)
    assert native.library() is None and "cannot be written" in native.problem
    assert not list(kernel_cache.root().iterdir())  # nothing half built is left


def test_a_compiler_that_hangs_is_stopped_with_its_children(home, tmp_path, monkeypatch):
    pid = tmp_path / "pid"
    stub(tmp_path, monkeypatch, body=f"sleep 1000 & echo $! > {pid}; wait")
    monkeypatch.setenv(native.BUILD_SECONDS, "1")
    assert native.library() is None and "ran past 1 s" in native.problem
    child = int(pid.read_text())
    deadline = time.monotonic() + 30  # SIGKILL is delivered, not awaited
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child)
    assert not [p for p in kernel_cache.root().iterdir()]  # its folder is gone too


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie no container init reaps does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_the_reason_goes_to_the_re_executed_process(monkeypatch):
    monkeypatch.setattr(native, "problem", None)
    monkeypatch.setenv(blas._WHY, "the kernel cache /x cannot be used: Not a directory")
    monkeypatch.setattr(native, "loaded", lambda: None)
    monkeypatch.setattr(blas, "openblas_loaded", lambda: True)
    monkeypatch.setattr(native, "library", lambda: pytest.fail("built again"))
    text, fast = blas.describe()
    assert "cannot be used: Not a directory" in text and fast
