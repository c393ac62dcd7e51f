"""A model's folder on this machine, fetched from the Hugging Face Hub when it is not.

mlx-lm fetches a model with a private function (`mlx_lm.utils._download`): the files it
loads, and no others, into the hub's cache. `download` is that call.
"""

from __future__ import annotations

from pathlib import Path


def download(path_or_repo: str) -> Path:
    """The local folder of `path_or_repo`: the path itself where it exists, else the hub
    repository's files mlx-lm loads, fetched (or found in the hub's cache)."""
    from mlx_lm.utils import _download  # imported late: it brings the hub client in

    return _download(path_or_repo)
