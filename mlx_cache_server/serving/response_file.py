"""Where a model's stored responses live on disk, and how their file is opened: named so
that distinct model ids never share one, and readable by the server's user alone.

Invariants:
- The file is `<cache dir>/responses/<slug>-<hash>.sqlite`: the slug keeps the id
  readable, a hash of the exact id keeps ids apart that the slug (or a filesystem that
  ignores case) would merge, as `org/m` and `org_m`.
- The folder is 0700 and the file 0600 whatever the umask, fixed at every opening;
  SQLite gives its journal the file's mode.
- A file of the old naming (`<slug>.sqlite`) is taken over only when no other id could
  have written it (the id is its own slug and has no `_`); any other is left unread
  (logged), since whose responses it holds cannot be told.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import sqlite3
from contextlib import closing
from pathlib import Path

log = logging.getLogger("mlx_cache_server")

SIDE_FILES = ("-journal", "-wal", "-shm")


def stored_responses_path(cache_dir: str | Path, model_id: str) -> Path:
    """The file of `model_id`'s stored responses under `cache_dir`."""
    digest = hashlib.sha256(model_id.encode()).hexdigest()[:16]
    return Path(cache_dir).expanduser() / "responses" / f"{_slug(model_id)[:64]}-{digest}.sqlite"


def _slug(model_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", model_id)


def open_private(path: Path, model_id: str | None = None) -> sqlite3.Connection:
    """An SQLite connection to `path`, its folder 0700 and it 0600 (created so, or fixed);
    given `model_id`, the old naming's file taken over first where it is surely its own."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    _make_private(path.parent, 0o700)
    if model_id is not None and not path.exists():
        _take_over_old_file(path, model_id)
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))  # not SQLite's 0644 less umask
    for p in (path, *(Path(f"{path}{s}") for s in SIDE_FILES)):
        if p.exists():
            _make_private(p, 0o600)
    return sqlite3.connect(path, check_same_thread=False, isolation_level=None)


def _make_private(path: Path, mode: int) -> None:
    try:
        os.chmod(path, mode)
    except PermissionError:  # not ours: usable maybe, but others may read it
        log.warning("stored responses: cannot make %s private (not owned by this user)", path)


def _take_over_old_file(path: Path, model_id: str) -> None:
    old = path.parent / f"{_slug(model_id)}.sqlite"
    if not old.exists():
        return
    if model_id != _slug(model_id) or "_" in model_id:
        log.warning(
            "stored responses in %s are not read: another model id may have written them "
            "(the file now is %s); delete it once not needed", old, path.name,
        )  # fmt: skip
        return
    try:  # copied through SQLite, which first rolls back a write a crash left half done
        os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
        with closing(sqlite3.connect(old)) as source, closing(sqlite3.connect(path)) as target:
            source.backup(target)
        for p in (old, *(Path(f"{old}{s}") for s in SIDE_FILES)):
            p.unlink(missing_ok=True)
        log.info("stored responses: %s renamed %s", old, path.name)
    except (OSError, sqlite3.Error) as e:
        path.unlink(missing_ok=True)
        log.warning("stored responses in %s could not be taken over (%s)", old, e)
