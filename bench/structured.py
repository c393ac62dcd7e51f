"""Constrained decoding's cost, and a tool conversation's cache reuse, on the default model.

Starts our server (OpenBLAS preloaded, as multiturn.py does) and, through the
`openai` SDK:

1. Decode speed with and without a JSON-schema constraint: questions of the same shape
   (each asked once: another city each time), greedy, streamed, constrained and free
   requests alternating; per-token decode
   time is (last token - first token) / (tokens - 1), so prefill does not count.
2. A 6-turn tool conversation (a forced call, its result, an answer, then the
   next question): each request's cached share of its prompt, and whether it
   reused all of the previous request's prompt and reply (the chat template
   re-rendered what was generated token for token) or less (template drift).
3. Forced `apply_patch` calls through the Responses API, with the Lark grammar
   Codex sends: of the calls that finished, the share whose input parses with
   that grammar (by llguidance's Lark parser, not the regex the server holds the
   call to), and how many finished within the token limit.

    python bench/structured.py [--rounds 6] [--turns 6] [--patches 12] [--only-patches]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from envelope import write_result
from harness import running
from openai import OpenAI

from mlx_cache_server.models.default_model import default_model_dir

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "maxLength": 40},
        "population_millions": {"type": "number"},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
    },
    "required": ["city", "country", "population_millions", "landmarks"],
    "additionalProperties": False,
}
CITIES = ["Paris", "Rome", "Madrid", "Berlin", "Vienna", "Lisbon", "Prague", "Dublin",
          "Oslo", "Warsaw", "Athens", "Brussels", "Budapest", "Helsinki", "Stockholm",
          "Copenhagen"]  # fmt: skip
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}


def per_token(client: OpenAI, city: str, constrained: bool) -> tuple[float, int]:
    extra = {}
    if constrained:
        extra["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": SCHEMA},
        }
    stream = client.chat.completions.create(
        model="bench",
        messages=[{"role": "user", "content": f"Describe {city} as JSON: city, country, "
                   "population in millions and up to three landmarks."}],
        max_tokens=64,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        **extra,
    )  # fmt: skip
    first = last = None
    tokens = 0
    for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].delta.content:
            last = time.perf_counter()
            first = first or last
    return (last - first) / max(tokens - 1, 1), tokens


def asked(rounds: int) -> list[tuple[str, bool]]:
    """Each round's two questions, (city, constrained), free or constrained first by turns.
    Each city once: a question asked again would be drafted from its earlier reply."""
    if 2 * rounds > len(CITIES):
        sys.exit(f"structured: --rounds {rounds} would ask of a city twice (at most "
                 f"{len(CITIES) // 2})")  # fmt: skip
    order = [(False, True) if i % 2 == 0 else (True, False) for i in range(rounds)]
    return [(CITIES[2 * i + c], c) for i, pair in enumerate(order) for c in pair]


def decode_cost(client: OpenAI, rounds: int) -> dict:
    free, constrained = [], []
    for city, c in asked(rounds):
        seconds, _ = per_token(client, city, c)
        (constrained if c else free).append(seconds)
    f, c = statistics.median(free), statistics.median(constrained)
    return {"free_ms_per_token": f * 1000, "constrained_ms_per_token": c * 1000, "ratio": c / f}


def tool_conversation(client: OpenAI, turns: int) -> list[dict]:
    messages: list = [{"role": "system", "content": "You are a weather assistant with tools."}]
    rows, previous = [], None

    def ask(**kwargs) -> object:
        nonlocal previous
        r = client.chat.completions.create(
            model="bench", messages=messages, tools=[WEATHER], temperature=0, **kwargs
        )
        u = r.usage
        whole = previous is not None and u.prompt_tokens_details.cached_tokens >= previous - 1
        rows.append(
            {
                "kind": kwargs.get("tool_choice"),
                "prompt": u.prompt_tokens,
                "cached": u.prompt_tokens_details.cached_tokens,
                "reused_previous_whole": whole if previous is not None else None,
            }
        )
        previous = u.prompt_tokens + u.completion_tokens
        return r

    for turn in range(turns):
        city = CITIES[turn % len(CITIES)]
        messages.append({"role": "user", "content": f"Will it rain in {city} this week?"})
        call = ask(tool_choice="required").choices[0].message
        messages.append(call)
        result = {"city": city, "rain_mm": [0, 2, 5][turn % 3]}
        messages.append(
            {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": json.dumps(result)}
        )
        answer = ask(tool_choice="none", max_tokens=32).choices[0].message
        messages.append({"role": "assistant", "content": answer.content})
    return rows


PATCH_ASKS = [
    "Rename the function foo to bar in src/app.py.",
    "Delete the file old_notes.txt.",
    "Add a file hello.py that prints hello.",
    "Fix the typo 'recieve' in README.md.",
    "Add a line 'import os' at the top of main.py.",
    "Change the port from 8000 to 9000 in config.py.",
]


def forced_patches(client: OpenAI, count: int) -> dict:
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.unit.test_lark_regex import APPLY_PATCH

    hf = AutoTokenizer.from_pretrained(str(default_model_dir()))
    tokenizer = llguidance.hf.from_tokenizer(hf)
    grammar = {"type": "grammar", "syntax": "lark", "definition": APPLY_PATCH}
    tool = {"type": "custom", "name": "apply_patch", "format": grammar,
            "description": "Edit files with a patch. This is a FREEFORM tool."}  # fmt: skip
    finished = parsed = 0
    for i in range(count):
        r = client.responses.create(
            model="bench", input=PATCH_ASKS[i % len(PATCH_ASKS)], tools=[tool],
            tool_choice={"type": "custom", "name": "apply_patch"}, max_output_tokens=400,
            temperature=0 if i < len(PATCH_ASKS) else 0.8,
        )  # fmt: skip
        calls = [o for o in r.output if o.type == "custom_tool_call"]
        if r.status != "completed" or not calls:
            continue
        finished += 1
        matcher = llguidance.LLMatcher(tokenizer, llguidance.grammar_from("lark", APPLY_PATCH))
        ids = hf.encode(calls[0].input, add_special_tokens=False)
        parsed += matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()
    return {"patch_calls": count, "patch_finished": finished, "patch_parsed": parsed,
            "patch_parsed_share": parsed / finished if finished else None}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--patches", type=int, default=12)
    ap.add_argument("--only-patches", action="store_true")
    args = ap.parse_args()
    started = time.time()
    model = str(default_model_dir())
    with running("ours", model, 32, 256 * 2**20) as server:
        client = OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0)
        per_token(client, "Oslo", True)  # warm-up: builds the grammar tokenizer
        patches = forced_patches(client, args.patches)
        if args.only_patches:
            print(patches)
            return
        cost = decode_cost(client, args.rounds)
        rows = tool_conversation(client, args.turns)
    later = rows[1:]
    report = {
        **cost,
        **patches,
        "tool_requests": len(rows),
        "tool_cached_share": sum(r["cached"] for r in later) / sum(r["prompt"] for r in later),
        "tool_reused_previous_whole": sum(bool(r["reused_previous_whole"]) for r in later),
        "tool_rows": rows,
    }
    summary = {k: v for k, v in report.items() if k != "tool_rows"}
    write_result("structured.json", args, started, summary, raw={"tool_rows": rows})
    for key, value in report.items():
        if key != "tool_rows":
            print(f"{key:>28}: {value}")
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
