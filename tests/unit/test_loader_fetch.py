"""`ModelLoader.fetch`: downloads and imports one at a time, a model already here at once."""

from __future__ import annotations

import threading
import time

import mlx_cache_server.models.loader as loader_module
from mlx_cache_server.models.loader import ModelLoader
from mlx_cache_server.models.pool import FetchUnavailable
from mlx_cache_server.models.specs import ModelSpec
from mlx_cache_server.settings import Settings


def test_downloads_go_one_at_a_time_and_a_model_already_here_does_not_wait(tmp_path, monkeypatch):
    here = tmp_path / "here"
    here.mkdir()
    running, most, calls = [0], [0], []
    lock, release, downloading = threading.Lock(), threading.Event(), threading.Event()

    def fetched_path(spec, progress=None):
        calls.append(spec.id)
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        if spec.id != "local":
            downloading.set()
            release.wait(5)
        time.sleep(0.05)
        with lock:
            running[0] -= 1
        folder = tmp_path / spec.id
        folder.mkdir(exist_ok=True)
        return str(folder)

    monkeypatch.setattr(loader_module, "fetched_path", fetched_path)
    (here / "model.safetensors").write_bytes(b"weights")  # the hub ids' folders have none yet
    monkeypatch.setattr(
        loader_module, "local_folder", lambda spec: here if spec.id == "local" else tmp_path
    )
    loader = ModelLoader(Settings(), serve=None)
    specs = [ModelSpec("hub-1", "org/one"), ModelSpec("hub-2", "org/two")]
    threads = [threading.Thread(target=loader.fetch, args=(s,)) for s in specs]
    for t in threads:
        t.start()
    assert downloading.wait(5)  # one download under way, the other waiting for it
    done = threading.Thread(target=loader.fetch, args=(ModelSpec("local", str(here)),))
    done.start()
    done.join(2)
    assert not done.is_alive()  # not held up by the downloads
    release.set()
    for t in threads:
        t.join(5)
    assert most[0] == 2  # the local one beside a download, never two downloads
    assert sorted(calls) == ["hub-1", "hub-2", "local"]


def test_a_fetch_failing_for_now_is_told_from_one_that_cannot_succeed(tmp_path, monkeypatch):
    import httpx2
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    def failing(status: int, kind: type = HfHubHTTPError) -> Exception:
        request = httpx2.Request("GET", "https://huggingface.co/api/models/x")
        return kind(f"{status}", response=httpx2.Response(status, request=request))

    errors = {
        "offline": LocalEntryNotFoundError("cannot find the files; check your connection"),
        "hub 503": failing(503),
        "hub 429": failing(429),
        "no such repo": failing(404, RepositoryNotFoundError),
        "gated": failing(401),
        "a file that is no GGUF": ValueError("not a GGUF file"),
    }
    recoverable = {name for name, e in errors.items() if loader_module.may_recover(e)}
    assert recoverable == {"offline", "hub 503", "hub 429"}
    from huggingface_hub import constants

    with monkeypatch.context() as offline:  # HF_HUB_OFFLINE=1: the files will not come
        offline.setattr(constants, "HF_HUB_OFFLINE", True)
        assert not loader_module.may_recover(errors["offline"])

    # The loader says so to the pool: its typed error, with the hub's message.
    monkeypatch.setattr(loader_module, "local_folder", lambda spec: None)
    loader = ModelLoader(Settings(), serve=None)
    for name, error in errors.items():

        def fetched_path(spec, progress=None, error=error):
            raise error

        monkeypatch.setattr(loader_module, "fetched_path", fetched_path)
        try:
            loader.fetch(ModelSpec("x", "org/x"))
        except Exception as e:
            assert isinstance(e, FetchUnavailable) == (name in recoverable), name
            assert str(error) in str(e)
        else:
            raise AssertionError(f"{name}: the fetch did not fail")
