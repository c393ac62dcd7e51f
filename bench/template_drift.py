"""How often a chat template re-renders the model's reply differently from how it was generated.

The server caches prompt + generated tokens. Next turn, the client sends the
reply back as text and the template renders it again; where that re-rendering
differs (end tokens, whitespace, a retokenization), reuse stops at the common
prefix. This measures it on the default model: the share of turns whose whole
reply is reused, and the tokens lost otherwise.

    python bench/template_drift.py [--model PATH] [--turns 20]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mlx_lm import load, stream_generate
from mlx_lm.sample_utils import make_sampler

from prompt_cache.radix import common_prefix_length

QUESTIONS = [
    "What is the capital of France?", "Give me three tips for sleeping well.",
    "Write a haiku about autumn.", "What is 17 times 23?", "Explain recursion briefly.",
    "Name two planets with rings.", "How do I reverse a list in Python?",
    "What does HTTP stand for?", "Translate 'good morning' to Spanish.",
    "Why is the sky blue?", "List the first five prime numbers.",
    "What is a black hole?", "Suggest a name for a cat.", "How many legs does a spider have?",
    "What is photosynthesis?", "Write one sentence about the sea.",
    "What year did the first moon landing happen?", "What is the boiling point of water?",
    "Give an example of a metaphor.", "What is the largest ocean?",
]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "drift.json")
    args = ap.parse_args()
    if args.model is None:
        from app.models.default_model import default_model_dir

        args.model = str(default_model_dir())
    model, tok = load(args.model)
    greedy = make_sampler(0.0)
    messages: list[dict] = []
    rows = []
    for question in QUESTIONS[: args.turns]:
        messages.append({"role": "user", "content": question})
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
        generated = [
            r.token
            for r in stream_generate(model, tok, prompt, max_tokens=args.max_tokens, sampler=greedy)
        ]
        reply = tok.decode([t for t in generated if t not in tok.eos_token_ids])
        messages.append({"role": "assistant", "content": reply})
        stored = prompt + generated
        nxt = tok.apply_chat_template(messages + [{"role": "user", "content": "ok"}],
                                      add_generation_prompt=True)  # fmt: skip
        kept = common_prefix_length(stored, nxt)
        rows.append({"stored": len(stored), "reused": kept, "lost": len(stored) - kept})
        if len(messages) > 8:  # keep the chat short enough for a small context
            messages = messages[-8:]
    whole = sum(r["lost"] == 0 for r in rows)
    lost = [r["lost"] for r in rows if r["lost"]]
    print(f"turns: {len(rows)}; whole reply reused: {whole}/{len(rows)}")
    if lost:
        print(f"where not: median {sorted(lost)[len(lost) // 2]} tokens lost, max {max(lost)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
