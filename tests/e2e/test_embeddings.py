"""POST /v1/embeddings through the `openai` SDK: one vector per input, pooled as the model's
sentence-transformers files say, the same alone or in any batch, and clear 400s for what
cannot be embedded."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import openai
import pytest
from mlx_lm import load

from mlx_cache_server.models.specs import ModelSpec
from tests.e2e.test_models import client, serving_models
from tests.tiny_model import build_tiny_model

# Also run with our kernels and the CPU fast path off (README, the portable lane).
pytestmark = pytest.mark.portable

TEXTS = ["Paris is the capital of France.", "hi", "A longer sentence about the cache, for padding."]


@pytest.fixture(scope="module")
def embedding_dir(tmp_path_factory) -> Path:
    """The tiny model as a sentence-transformers embedding model: last-token pooling, then
    normalized (as Qwen3-Embedding's files declare)."""
    folder = build_tiny_model(Path(tmp_path_factory.mktemp("tiny-embed")) / "m", seed=2)
    kinds = {"": "Transformer", "1_Pooling": "Pooling", "2_Normalize": "Normalize"}
    modules = [
        {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
        for i, (path, kind) in enumerate(kinds.items())
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": 64, "pooling_mode_lasttoken": True}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return folder


@pytest.fixture(scope="module")
def live(embedding_dir, tiny_model_dir):
    models = [
        ModelSpec("chat", str(tiny_model_dir)),
        ModelSpec("embed", str(embedding_dir)),
        # A plain model folder, configured as an embedding model with mean pooling.
        ModelSpec("mean", str(tiny_model_dir), embedding=True, pooling="mean", normalize=False),
    ]
    with serving_models(models) as server:
        yield server


def hidden_states(folder: Path, text: str) -> np.ndarray:
    """The model's final hidden states for one text, computed here without the server."""
    model, tokenizer = load(str(folder))
    return np.array(model.model(mx.array([tokenizer.encode(text)]))[0].astype(mx.float32))


def test_vectors_are_the_models_pooled_hidden_states(live, embedding_dir, tiny_model_dir):
    c = client(live.url)
    r = c.embeddings.create(model="embed", input=TEXTS)  # the SDK asks for base64
    assert [d.index for d in r.data] == [0, 1, 2] and r.model == "embed"
    vectors = np.array([d.embedding for d in r.data])
    assert vectors.shape == (3, 64)
    for text, vector in zip(TEXTS, vectors, strict=True):
        last = hidden_states(embedding_dir, text)[-1]
        np.testing.assert_allclose(vector, last / np.linalg.norm(last), atol=1e-5)
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, TEXTS))  # one per char
    mean = c.embeddings.create(model="mean", input=TEXTS[0], encoding_format="float")
    expected = hidden_states(tiny_model_dir, TEXTS[0]).mean(axis=0)
    np.testing.assert_allclose(mean.data[0].embedding, expected, rtol=1e-4, atol=1e-5)


def test_an_input_embeds_the_same_alone_in_a_batch_and_in_either_format(live):
    c = client(live.url)
    alone = [c.embeddings.create(model="embed", input=t).data[0].embedding for t in TEXTS]
    batch = c.embeddings.create(model="embed", input=TEXTS[::-1], encoding_format="float")
    together = [d.embedding for d in batch.data][::-1]
    np.testing.assert_allclose(np.array(alone), np.array(together), atol=1e-5)
    again = c.embeddings.create(model="embed", input=TEXTS[0]).data[0].embedding
    assert again == alone[0]  # deterministic


def test_tokens_in_and_shortened_vectors(live):
    c = client(live.url)
    tokens = [40, 41, 42, 43]
    one = c.embeddings.create(model="embed", input=tokens).data[0].embedding
    many = c.embeddings.create(model="embed", input=[tokens, tokens[:2]]).data
    assert np.allclose(one, many[0].embedding, atol=1e-5) and len(many) == 2
    short = c.embeddings.create(model="embed", input="hi", dimensions=16).data[0].embedding
    full = np.array(c.embeddings.create(model="embed", input="hi").data[0].embedding)
    assert len(short) == 16 and np.isclose(np.linalg.norm(short), 1.0)
    np.testing.assert_allclose(short, full[:16] / np.linalg.norm(full[:16]), atol=1e-5)


@pytest.mark.parametrize(
    "kwargs, status, says",
    [
        ({"model": "chat", "input": "hi"}, 400, "has no embeddings"),
        ({"model": "nope", "input": "hi"}, 404, "does not exist"),
        ({"model": "embed", "input": ""}, 400, "empty"),
        ({"model": "embed", "input": []}, 400, "empty"),
        ({"model": "embed", "input": [[1, 2], []]}, 400, "input[1] is empty"),
        ({"model": "embed", "input": [10**6]}, 400, "outside the vocabulary"),
        ({"model": "embed", "input": "x" * 5000}, 400, "at most 4096"),
        ({"model": "embed", "input": "hi", "dimensions": 65}, 400, "at most 64"),
        ({"model": "embed", "input": [True]}, 400, "input"),
        ({"model": "embed", "input": ["x" * 150] * 2048}, 400, "300000 tokens in all"),
    ],
)
def test_what_cannot_be_embedded_is_a_clear_error(live, kwargs, status, says):
    with pytest.raises(openai.APIStatusError) as e:
        client(live.url).embeddings.create(encoding_format="float", **kwargs)
    assert e.value.status_code == status and says in str(e.value), str(e.value)


def test_an_embedding_model_asked_to_chat_and_the_model_list(live):
    c = client(live.url)
    with pytest.raises(openai.BadRequestError, match="use POST /v1/embeddings"):
        c.chat.completions.create(model="embed", messages=[{"role": "user", "content": "hi"}])
    types = {m.id: m.model_extra["type"] for m in c.models.list().data}
    assert types == {"chat": "chat", "embed": "embedding", "mean": "embedding"}
    import httpx

    cache = httpx.get(live.url + "/v1/cache", params={"model": "embed"}).json()
    assert cache["enabled"] is False and cache["model"] == "embed"


def test_a_long_input_runs_in_chunks_and_embeds_as_in_one_pass(live, embedding_dir):
    text = "A long document about caches. " * 60  # 1,800 tokens: over CHUNK, so in chunks
    got = client(live.url).embeddings.create(model="embed", input=text).data[0].embedding
    last = hidden_states(embedding_dir, text)[-1]
    np.testing.assert_allclose(got, last / np.linalg.norm(last), atol=1e-5)


def test_text_no_tokenizer_takes_is_a_400_not_a_500(live):
    import httpx

    body = json.dumps({"model": "embed", "input": ["ok", "a\udfffb"]})  # an escaped surrogate
    r = httpx.post(
        live.url + "/v1/embeddings", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"]


def test_a_hub_model_not_downloaded_yet_is_fetched_to_learn_its_kind(
    embedding_dir, tiny_model_dir, monkeypatch
):
    import mlx_cache_server.models.loader as loader

    hub = {"org/embedder": embedding_dir, "org/chatter": tiny_model_dir}  # "downloaded" here
    monkeypatch.setattr(loader, "fetched_path", lambda spec, progress=None: str(hub[spec.path]))
    models = [ModelSpec("hub-embed", "org/embedder"), ModelSpec("hub-chat", "org/chatter")]
    with serving_models(models) as server:
        c = client(server.url)
        types = {m.id: m.model_extra["type"] for m in c.models.list().data}
        assert types == {"hub-embed": None, "hub-chat": None}  # no files yet to tell
        r = c.embeddings.create(model="hub-embed", input="hi", encoding_format="float")
        assert len(r.data[0].embedding) == 64  # not a 400: its files said what it is
        with pytest.raises(openai.BadRequestError, match="has no embeddings"):
            c.embeddings.create(model="hub-chat", input="hi")  # a 400 once known to chat
        types = {m.id: m.model_extra["type"] for m in c.models.list().data}
        assert types == {"hub-embed": "embedding", "hub-chat": "chat"}


@pytest.mark.parametrize("default", ["embed", "chat"])
def test_a_name_no_model_has_is_answered_where_the_default_model_can(
    embedding_dir, tiny_model_dir, default
):
    """`--answer-any-model on`: the default model answers names no model has on the
    embeddings API too, where it is an embedding model; a chat model cannot, and the name
    stays unknown there (and the other way round on chat)."""
    specs = [ModelSpec("embed", str(embedding_dir)), ModelSpec("chat", str(tiny_model_dir))]
    specs = specs if default == "embed" else specs[::-1]
    with serving_models(specs, answer_any_model="on") as server:
        c = client(server.url)
        chat = [{"role": "user", "content": "hi"}]
        if default == "embed":
            r = c.embeddings.create(model="text-embedding-3-small", input="hi")
            assert r.model == "text-embedding-3-small" and len(r.data[0].embedding) == 64
            with pytest.raises(openai.NotFoundError):
                c.chat.completions.create(model="gpt-5", messages=chat, max_tokens=2)
        else:
            r = c.chat.completions.create(model="gpt-5", messages=chat, max_tokens=2)
            assert r.model == "gpt-5"
            with pytest.raises(openai.NotFoundError):
                c.embeddings.create(model="text-embedding-3-small", input="hi")
