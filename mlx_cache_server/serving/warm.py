"""Prompts prefilled at start (`--warm-prompts FILE`), so the first user never waits on them.

The file is JSON: a list whose items are either plain text or a chat request's
`{"messages": [...], "tools": [...]}` (tools optional). A chat item goes through the
model's chat template without a generation prompt, so its system prompt and tool
definitions come out as exactly the start of every request that sends them. Each is
generated for one token in every tenant's namespace, which leaves its KV in the
cache (and in the disk tier, for the next start).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

from ..engine import Engine, Failed, Finished, SamplingParams
from .attribution import strip_attribution

log = logging.getLogger("mlx_cache_server")

WAIT = 3600.0  # seconds one prompt may take before the rest are given up


def load_warm_prompts(path: Path) -> list[str | dict[str, Any]]:
    """The file's prompts, or a ValueError saying what is wrong with it."""
    try:
        items = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the warm prompts in {path}: {e}") from e
    if not isinstance(items, list):
        raise ValueError(f"{path}: expected a JSON list of prompts")
    for i, item in enumerate(items):
        chat = isinstance(item, dict) and isinstance(item.get("messages"), list)
        if not (isinstance(item, str) or chat):
            raise ValueError(f'{path}: item {i} is neither text nor {{"messages": [...]}}')
    return items


def warm_tokens(
    engine: Engine,
    item: str | dict[str, Any],
    strip: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The item's tokens; `strip`: as `--strip-attribution-header` renders requests;
    `template_kwargs`: the model's template variables, as requests are rendered."""
    if isinstance(item, str):
        return list(engine.tokenizer.encode(item))
    kwargs = dict(template_kwargs or {})
    if item.get("tools"):
        kwargs["tools"] = item["tools"]
    messages = strip_attribution(item["messages"]) if strip else item["messages"]
    return list(
        engine.tokenizer.apply_chat_template(messages, add_generation_prompt=False, **kwargs)
    )


def warm(
    engine: Engine,
    items: list[str | dict[str, Any]],
    namespaces: list[str | None],
    strip: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> int:
    """Prefill every prompt in every namespace, one at a time; the tokens prefilled."""
    t0, total = time.perf_counter(), 0
    namespaces = list(dict.fromkeys(namespaces))  # keys of one tenant warm it once
    for i, item in enumerate(items):
        try:
            tokens = warm_tokens(engine, item, strip, template_kwargs)
        except Exception as e:  # a template that rejects it: the others still count
            log.warning("warm prompt %d not used: %s", i, e)
            continue
        if len(tokens) >= engine.context_length:
            log.warning("warm prompt %d not used: longer than the context", i)
            continue
        for namespace in namespaces:
            done = threading.Event()
            ended: list[Any] = []

            def emit(event: Any, done: threading.Event = done, ended: list = ended) -> None:
                if isinstance(event, Finished | Failed):
                    ended.append(event)
                    done.set()

            engine.submit(tokens, SamplingParams(max_tokens=1, temperature=0.0), emit, namespace)
            if not done.wait(WAIT) or isinstance(ended[0], Failed):
                why = ended[0].message if ended else f"not done in {WAIT:g} s"
                log.warning("warm prompt %d not used: %s", i, why)
                break
            total += len(tokens)
    log.info("warmed %d prompts, %d tokens, in %.1f s", len(items), total, time.perf_counter() - t0)
    return total
