"""The folder our compiled kernels are kept in, and the checks a library passes before it
is loaded.

What is kept here runs inside the server (LD_PRELOAD, `dlopen`) and its children, before
anything could catch a fault: a truncated library is a SIGBUS with no log line, a library
put here by another user runs its constructors as ours. So:

- the folders below the cache's base (`mlx-cache-server/kernels/<key>/`) are created 0700;
  each must be a real folder owned by this user and writable by no one else, and so must
  each library and its digest file; otherwise nothing here is loaded (`Unusable`).
- a build is published whole: it is compiled into a private folder beside the others,
  with a digest file (`<library>.sha256`: its size and SHA-256, created 0600), and that
  folder is renamed to `<key>/`. The final path never holds a partial file. A published
  folder is never rewritten (a process that mapped its library keeps it); one whose
  library fails its digest is discarded whole, and built again.
- a library is loaded only when its size and digest match the file beside it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
from pathlib import Path

FOLDERS = ("mlx-cache-server", "kernels")  # below the cache's base, ours
DIGEST = ".sha256"


class Unusable(Exception):
    """Why the kernel cache cannot be used at all (nothing in it is loaded or built)."""


def base() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


def root() -> Path:
    """The folder the builds' folders are in, created 0700 where missing; `Unusable` if it
    cannot be, or if it or a folder on the way is not this user's alone."""
    path = base()
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        for name in FOLDERS:
            path = path / name
            _folder(path)
    except OSError as e:
        raise Unusable(f"the kernel cache {path} cannot be used: {e.strerror or e}") from e
    return path


def find(key: str, name: str) -> Path | None:
    """`key`'s library `name`, if it is built and whole; None if it is to be built (a
    folder whose library fails its digest is discarded first). `Unusable` as `root`."""
    folder = root() / key
    if not os.path.lexists(folder):
        return None
    _check(folder, stat.S_ISDIR)
    library = folder / name
    if matches(library):
        return library
    discard(folder)
    return None


def staging(key: str) -> Path:
    """A new private folder (0700) to build `key`'s files in, beside where they go."""
    return Path(tempfile.mkdtemp(prefix=f".{key}.", suffix=".tmp", dir=root()))


def publish(staged: Path, key: str, name: str) -> Path | None:
    """Publish the library `name` built in `staged` as `key`'s: its digest written
    beside it, the folder renamed into place; a folder another process published first
    is kept and ours dropped. The published library, if it is whole."""
    library = staged / name
    fd = os.open(staged / (name + DIGEST), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"{library.stat().st_size} {_sha256(library)}\n")
    try:
        staged.rename(staged.parent / key)
    except OSError:  # there already: a start beside this one built it too
        discard(staged)
    return find(key, name)


def matches(library: Path) -> bool:
    """Whether `library` and its digest file are this user's alone, and its size and
    SHA-256 are the digest's."""
    digest = library.with_name(library.name + DIGEST)
    try:
        _check(library, stat.S_ISREG)
        _check(digest, stat.S_ISREG, private=True)
        size, sha = digest.read_text().split()
        return library.stat().st_size == int(size) and _sha256(library) == sha
    except (OSError, ValueError, Unusable):
        return False


def discard(folder: Path) -> None:
    """Remove one build's folder: renamed aside first, so no one finds it half removed."""
    aside = folder.with_name(f".{folder.name}.{os.getpid()}.old")
    try:
        folder.rename(aside)
    except OSError:
        return
    shutil.rmtree(aside, ignore_errors=True)


def _folder(path: Path) -> None:
    """Create `path` 0700 if it is missing; `Unusable` unless it is this user's alone."""
    try:
        path.mkdir(mode=0o700)
    except OSError:  # there already (a read-only home may hold a cache built before)
        if not os.path.lexists(path):
            raise
    _check(path, stat.S_ISDIR)


def _check(path: Path, kind, private: bool = False) -> None:
    """`Unusable` unless `path` (not followed if a link) is of `kind`, owned by this user
    and writable by no one else (with `private`, not readable by anyone else either)."""
    st = os.lstat(path)
    if not kind(st.st_mode):
        raise Unusable(f"{path} is not a {'folder' if kind is stat.S_ISDIR else 'file'}")
    if st.st_uid != os.getuid():
        raise Unusable(f"{path} is owned by another user (uid {st.st_uid})")
    if st.st_mode & (0o077 if private else 0o022):
        raise Unusable(f"{path} is open to other users (mode {stat.S_IMODE(st.st_mode):o})")


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
