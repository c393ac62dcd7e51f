"""An agent-shaped workload through /v1/messages and /v1/responses, ours against mlx_lm.server.

The session is Claude Code's shape, scripted: a long system prompt with the tool
definitions written into it, a task, then turns of one tool call (Read, Grep, Bash,
Edit...) and its result (a few hundred tokens of file or command output), the user
adding a word every fifth turn. The assistant's turns are scripted, not the model's:
the default 135M model cannot drive an agent, and a script keeps the token streams the
same for every server. Each turn's request is the whole history so far and generates a
few tokens (greedy); its TTFT and cached share (cached / prompt tokens) are recorded.

Two runs, every server up side by side, each turn sent to each in rotating order:

  messages   Claude Code through /v1/messages. Its system prompt starts with
             `x-anthropic-billing-header: ...; cch=XXXXX;`, cch changing with every
             request (`--cch session`: once per session, as from Claude Code 2.1.181).
             Servers: ours with --keep-attribution-header, ours as it starts (the
             line cut), and mlx_lm.server
             (chat completions, the same messages).
  responses  Codex through /v1/responses (instructions and items; no changing span).
             Servers: ours and mlx_lm.server.

Sessions after the first (a few turns each) share the system prompt and start a new
task, as a new Claude Code session in the same project does. Every turn each server
must see the same prompt length (ours: input + cached, the peer: prompt_tokens), or
the run says so.

    python bench/agent.py [--turns 20] [--sessions 2] [--later-turns 3] [--cch request|session]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from anthropic import AsyncAnthropic
from envelope import RESULTS, read_raw, write_result
from harness import WORDS, running
from openai import AsyncOpenAI

from mlx_cache_server.models.default_model import default_model_dir
from mlx_cache_server.serving import prompted_tools

TOOLS = {
    "Read": {"file_path": "string", "offset": "integer", "limit": "integer"},
    "Grep": {"pattern": "string", "path": "string", "glob": "string"},
    "Glob": {"pattern": "string", "path": "string"},
    "Bash": {"command": "string", "timeout": "integer", "description": "string"},
    "Edit": {"file_path": "string", "old_string": "string", "new_string": "string"},
    "Write": {"file_path": "string", "content": "string"},
    "TodoWrite": {"todos": "array"},
    "WebFetch": {"url": "string", "prompt": "string"},
}


@dataclass
class Turn:
    run: str
    server: str
    session: int
    turn: int
    ttft: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class Session:
    """One scripted session: a task, then (thought, tool call, result, user word) turns."""

    task: str
    turns: list[dict] = field(default_factory=list)


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def system_text(n_words: int) -> str:
    rng = random.Random(7)
    tools = [
        {
            "name": name,
            "description": words(rng, 40),
            "input_schema": {
                "type": "object",
                "properties": {k: {"type": t, "description": words(rng, 8)} for k, t in ps.items()},
                "required": [next(iter(ps))],
            },
        }
        for name, ps in TOOLS.items()
    ]
    return (
        "You are an interactive CLI tool that helps users with software engineering tasks.\n\n"
        + words(rng, n_words)
        + "\n\n# Tools\n\n"
        + "\n".join(json.dumps(t) for t in tools)
    )


def script(session: int, turns: int, result_words: int) -> Session:
    rng = random.Random(100 + session)
    s = Session(task=f"Session {session}: fix the failing test in module {rng.randint(1, 99)}.")
    for t in range(turns):
        name = rng.choice(list(TOOLS))
        arguments = {k: f"{k}-{session}-{t}" for k in list(TOOLS[name])[:2]}
        s.turns.append(
            {
                "thought": f"Step {t}: " + words(rng, 12),
                "name": name,
                "input": arguments,
                "result": words(rng, rng.randint(result_words // 2, result_words * 3 // 2)),
                "user": f"Also check case {t}." if t % 5 == 4 else None,
            }
        )
    return s


def header(rng: random.Random) -> str:
    cch = "".join(rng.choice("0123456789abcdef") for _ in range(5))
    return f"x-anthropic-billing-header: cc_version=2.1.128.bd9; cc_entrypoint=cli; cch={cch};"


def anthropic_request(system: str, head: str | None, s: Session, upto: int) -> dict:
    messages: list[dict] = [{"role": "user", "content": s.task}]
    for i, turn in enumerate(s.turns[:upto]):
        use = {"type": "tool_use", "id": f"toolu_{i:04d}", "name": turn["name"]}
        messages.append(
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": turn["thought"]},
                    {**use, "input": turn["input"]},
                ],
            }
        )
        blocks = [{"type": "tool_result", "tool_use_id": use["id"], "content": turn["result"]}]
        if turn["user"]:
            blocks.append({"type": "text", "text": turn["user"]})
        messages.append({"role": "user", "content": blocks})
    blocks = ([{"type": "text", "text": head}] if head else []) + [{"type": "text", "text": system}]
    return {"system": blocks, "messages": messages}


def responses_request(system: str, s: Session, upto: int) -> dict:
    items: list[dict] = [{"role": "user", "content": s.task}]
    for i, turn in enumerate(s.turns[:upto]):
        items += [
            {"role": "assistant", "content": [{"type": "output_text", "text": turn["thought"]}]},
            {
                "type": "function_call",
                "call_id": f"call_{i:04d}",
                "name": turn["name"],
                "arguments": json.dumps(turn["input"]),
            },
            {"type": "function_call_output", "call_id": f"call_{i:04d}", "output": turn["result"]},
        ]
        if turn["user"]:
            items.append({"role": "user", "content": turn["user"]})
    return {"instructions": system, "input": items}


def chat_messages(system: str, head: str | None, s: Session, upto: int) -> list[dict]:
    """What our servers render for either request, as chat messages for mlx_lm.server.

    The default model's template knows no tools, so our server writes calls and results
    in its own protocol (`prompted_tools.history`); the peer is given that same text, so
    both prefill the same prompt (the run checks it: `prompt_lengths_agree`).
    """
    messages = [
        {"role": "system", "content": f"{head}\n\n{system}" if head else system},
        {"role": "user", "content": s.task},
    ]
    for i, turn in enumerate(s.turns[:upto]):
        function = {"name": turn["name"], "arguments": turn["input"]}
        call = {"id": f"call_{i:04d}", "type": "function", "function": function}
        messages += [
            {"role": "assistant", "content": turn["thought"], "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": turn["result"]},
        ]
        if turn["user"]:
            messages.append({"role": "user", "content": turn["user"]})
    return prompted_tools.history(messages, [])


async def via_messages(port: int, request: dict, max_tokens: int, out: Turn) -> None:
    client = AsyncAnthropic(base_url=f"http://127.0.0.1:{port}", api_key="x", max_retries=0)
    t0 = time.perf_counter()
    async with client.messages.stream(
        model="claude-sonnet-4-6",
        max_tokens=max_tokens,
        extra_body={"temperature": 0},
        **request,
    ) as stream:
        async for event in stream:
            if event.type in ("content_block_delta", "message_delta") and not out.ttft:
                out.ttft = time.perf_counter() - t0
        usage = (await stream.get_final_message()).usage
    out.cached_tokens = usage.cache_read_input_tokens or 0
    out.prompt_tokens = usage.input_tokens + out.cached_tokens


async def via_responses(port: int, request: dict, max_tokens: int, out: Turn) -> None:
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    t0 = time.perf_counter()
    async with client.responses.stream(
        model="bench", max_output_tokens=max_tokens, temperature=0, **request
    ) as stream:
        async for event in stream:
            if event.type.startswith("response.output_") and "delta" in event.type:
                out.ttft = out.ttft or time.perf_counter() - t0
            if event.type in ("response.completed", "response.incomplete"):
                usage = event.response.usage  # the SDK's final response wants "completed"
    out.ttft = out.ttft or time.perf_counter() - t0
    out.prompt_tokens = usage.input_tokens
    out.cached_tokens = usage.input_tokens_details.cached_tokens


async def via_chat(port: int, request: dict, max_tokens: int, out: Turn) -> None:
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    t0 = time.perf_counter()
    stream = await client.chat.completions.create(
        **request, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and not out.ttft:
            out.ttft = time.perf_counter() - t0
        if chunk.usage is not None:
            out.prompt_tokens = chunk.usage.prompt_tokens
            details = chunk.usage.prompt_tokens_details
            out.cached_tokens = (details.cached_tokens or 0) if details else 0
    out.ttft = out.ttft or time.perf_counter() - t0


async def run(args, ports: dict[str, int], system: str, model: str) -> list[Turn]:
    turns: list[Turn] = []
    rng = random.Random(1)
    for session in range(args.sessions):
        n = args.turns if session == 0 else args.later_turns
        s = script(session, n, args.result_words)
        session_head = header(rng)
        for upto in range(n + 1):
            head = header(rng) if args.cch == "request" else session_head
            anthropic = anthropic_request(system, head, s, upto)
            responses = responses_request(system, s, upto)
            sends = {
                ("messages", "ours"): (via_messages, ports["ours"], anthropic),
                ("messages", "ours-strip"): (via_messages, ports["ours-strip"], anthropic),
                ("messages", "peer"): (
                    via_chat,
                    ports["peer"],
                    # mlx_lm.server serves the model by its path
                    {"model": model, "messages": chat_messages(system, head, s, upto)},
                ),
                ("responses", "ours"): (via_responses, ports["ours"], responses),
                ("responses", "peer"): (
                    via_chat,
                    ports["peer"],
                    {"model": model, "messages": chat_messages(system, None, s, upto)},
                ),
            }
            order = list(sends)
            shift = upto % len(order)
            for key in order[shift:] + order[:shift]:
                out = Turn(key[0], key[1], session, upto)
                send, port, payload = sends[key]
                await send(port, payload, args.max_tokens, out)
                turns.append(out)
            print(
                f"session {session} turn {upto:2d}: "
                + "  ".join(
                    f"{t.run[0]}/{t.server} {t.ttft:.2f}s {t.cached_tokens}/{t.prompt_tokens}"
                    for t in turns[-len(order) :]
                ),
                flush=True,
            )
    return turns


def summarize(turns: list[Turn]) -> dict:
    out: dict = {}
    for run_name in ("messages", "responses"):
        mine = [t for t in turns if t.run == run_name]
        servers = sorted({t.server for t in mine})
        by = {(t.server, t.session, t.turn): t for t in mine}
        keys = sorted({(t.session, t.turn) for t in mine})
        same = [k for k in servers if k != "ours-strip"]  # its prompts lack the line, by design
        lengths_agree = all(len({by[(k, *key)].prompt_tokens for k in same}) == 1 for key in keys)
        row: dict = {"prompt_lengths_agree": lengths_agree}
        for server in servers:
            ts = [by[(server, *key)] for key in keys]
            later = [t for t in ts if t.turn > 0]
            row[server] = {
                "ttft_median_after_first": statistics.median(t.ttft for t in later),
                "ttft_median_first_turns": statistics.median(t.ttft for t in ts if t.turn == 0),
                "cached_share": sum(t.cached_tokens for t in ts) / sum(t.prompt_tokens for t in ts),
                "cached_share_first_turns": statistics.median(
                    t.cached_tokens / t.prompt_tokens for t in ts if t.turn == 0
                ),
            }
            if server != "peer":
                row[server]["ttft_ratio_to_peer"] = statistics.median(
                    by[(server, *key)].ttft / by[("peer", *key)].ttft for key in keys if key[1] > 0
                )
        out[run_name] = row
    return out


def plot(turns: list[Turn], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, run_name in zip(axes, ("messages", "responses"), strict=True):
        mine = [t for t in turns if t.run == run_name and t.session == 0]
        for server in sorted({t.server for t in mine}):
            ts = sorted((t for t in mine if t.server == server), key=lambda t: t.turn)
            ax.plot([t.turn for t in ts], [t.ttft for t in ts], marker="o", label=server)
        ax.set_title(f"/v1/{run_name}: TTFT by turn (session 1)")
        ax.set_xlabel("turn")
        ax.set_ylabel("seconds")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--sessions", type=int, default=2)
    ap.add_argument("--later-turns", type=int, default=3, help="turns of sessions after the first")
    ap.add_argument("--cch", choices=("request", "session"), default="request")
    ap.add_argument("--system-words", type=int, default=600)
    ap.add_argument("--result-words", type=int, default=60)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--model", default=None, help="model folder (default: the embedded one)")
    ap.add_argument("--report", action="store_true",
                    help="plot the last run's raw records again, run nothing")  # fmt: skip
    args = ap.parse_args()
    if args.report:
        turns = [Turn(**t) for t in read_raw("agent")["turns"]]
        plot(turns, RESULTS / "agent.png")
        print(json.dumps(summarize(turns), indent=1))
        return
    started = time.time()
    model = args.model or str(default_model_dir())
    system = system_text(args.system_words)
    budget = 2 * 1024**3
    with (
        running("ours", model, 64, budget, ["--keep-attribution-header"]) as ours,
        running("ours", model, 64, budget) as strip,
        running("peer", model, 64, budget) as peer,
    ):
        ports = {"ours": ours.port, "ours-strip": strip.port, "peer": peer.port}
        turns = asyncio.run(run(args, ports, system, model))
    summary = summarize(turns)
    summary["settings"] = {k: str(v) for k, v in vars(args).items()}
    summary["peak_rss_mib"] = {
        "ours": ours.peak_rss / 2**20, "ours-strip": strip.peak_rss / 2**20,
        "peer": peer.peak_rss / 2**20,
    }  # fmt: skip
    path = write_result("agent.json", args, started, summary,
                        raw={"turns": [asdict(t) for t in turns]})  # fmt: skip
    plot(turns, path.with_suffix(".png"))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
