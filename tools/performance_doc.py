"""Write docs/performance.md from the result files: one table per question, each figure with
what it is compared against, the ratio, the command that reproduces it and the commit and
machine its result came from (the result's envelope, bench/envelope.py).

    python tools/performance_doc.py          # rewrite docs/performance.md
    python tools/performance_doc.py --check  # exit 1 if the doc is not what the results give

Only figures the result files hold appear; FIGURES says which, and where in a result each is.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "performance.md"
Get = Callable[[dict], Any]  # from a result's summary (the whole result as `_result`)


@dataclass(frozen=True)
class Figure:
    workload: str
    label: str
    ours: Get | None
    other: Get | None
    against: str  # what `other` is: mlx_lm.server, ours --no-cache, a floor, ...
    unit: str
    ratio: Get | None = None  # when the result holds its own (a median of paired ratios)


def at(*keys: Any) -> Get:
    def get(summary: Any) -> Any:
        for k in keys:
            summary = summary[k]
        return summary

    return get


def scaled(get: Get, key: str) -> Get:
    """Bytes as MiB; other figures as they are."""
    return (lambda s: get(s) / 2**20) if key.startswith("bytes") else get


PEER = "mlx_lm.server"
MULTITURN = [("1-sequential", "sequential chats"),
             ("2-shared", "16 chats sharing a system prompt"),
             ("3-overflow", "more chats than the budget holds"),
             ("4-branching", "regenerate, edit")]  # fmt: skip

# fmt: off
FIGURES: dict[str, list[Figure]] = {
    "TTFT": [
        Figure("warm-paired", "warm turn, both servers up", at("warm_ttft_ours_median_s"),
               at("warm_ttft_peer_median_s"), PEER, "s", at("warm_ratio_median")),
        Figure("warm-paired", "regenerate or edit, both up", None, None, PEER, "",
               at("branch_ratio_median")),
        *[Figure("ttft-floor", f"warm turn, {n} new tokens", at(i, "ours", "ttft"),
                 at(i, "ours", "floor"), "prefilling them in-process", "s",
                 at(i, "ours", "ratio")) for i, n in enumerate((100, 250, 500, 2000, 8000))],
        Figure("arrivals", "8 cold prompts arriving together", at("ours", "median_ttft"),
               at("peer", "median_ttft"), PEER, "s"),
        Figure("cache-cost", "no reuse possible", at("ttft_cached_median_s"),
               at("ttft_uncached_median_s"), "ours --no-cache", "s",
               lambda s: 1 + s["cost_median_pct"] / 100),
        Figure("multiturn", "first turn, 16 chats sharing a prompt",
               at("2-shared", "ours", "cold_ttft_median"),
               at("2-shared", "peer", "cold_ttft_median"), PEER, "s"),
    ],
    "throughput": [
        *[Figure("decode", f"decode, {n} streams", at("ours", n, "tokens_per_s"),
                 at("peer", n, "tokens_per_s"), PEER, "tokens/s", at("ours", n, "over_peer"))
          for n in ("8", "16")],
        Figure("mixed", "long prompt's TTFT beside 4 streams", at("ours", "ttft_beside_streams"),
               at("peer", "ttft_beside_streams"), PEER, "s"),
        Figure("mixed", "streams' longest gap during that prefill", at("ours", "longest_gap"),
               at("peer", "longest_gap"), PEER, "s"),
        *[Figure("speculation", f"{what}, drafts on", at(w, "tokens_per_s", "ours"),
                 at(w, "tokens_per_s", other), against, "tokens/s")
          for w, what in (("edit-1", "an edit, one stream"), ("edit-4", "an edit, 4 streams"),
                          ("chat-1", "short chat answers"))
          for other, against in (("peer", PEER), ("ours-plain", "ours without drafts"))],
        Figure("speculation", "an edit, one stream", at("edit-1", "tokens_per_s", "ours"),
               at("edit-1", "tokens_per_s", "llama:ngram-mod"), "llama.cpp, ngram-mod",
               "tokens/s"),
        *[Figure("speculation-batches", what, at(w, "tokens_per_s", "ours"),
                 at(w, "tokens_per_s", "ours-plain"), "ours without drafts", "tokens/s")
          for w, what in (("mixed-edit", "an edit beside 3 chats"),
                          ("sharegpt", "ShareGPT questions, 4 at a time"))],
        *[Figure("cpu-attention", f"warm turn over {n} cached tokens (Linux CPU)",
                 at("servers", "warm_ttft_100_new", "ours", n),
                 at("servers", "warm_ttft_100_new", "peer", n), PEER, "s")
          for n in ("1000", "8000")],
    ],
    "reuse": [
        *[Figure("multiturn", f"{what}: warm TTFT", at(w, "ours", "warm_ttft_median"),
                 at(w, "peer", "warm_ttft_median"), PEER, "s") for w, what in MULTITURN],
        *[Figure("multiturn", f"{what}: reuse", at(w, "ours", "reuse"), at(w, "peer", "reuse"),
                 PEER, "cached/prompt") for w, what in MULTITURN],
        Figure("sharegpt", "ShareGPT chats: warm TTFT", at("ours", "warm_ttft_median"),
               at("peer", "warm_ttft_median"), PEER, "s", at("ours", "warm_vs_peer")),
        Figure("sharegpt", "ShareGPT chats: first turn", at("ours", "cold_ttft_median"),
               at("peer", "cold_ttft_median"), PEER, "s", at("ours", "cold_vs_peer")),
        Figure("agent", "Claude Code session (/v1/messages): later turns",
               at("messages", "ours-strip", "ttft_median_after_first"),
               at("messages", "peer", "ttft_median_after_first"), PEER, "s"),
        Figure("agent", "Codex session (/v1/responses): later turns",
               at("responses", "ours", "ttft_median_after_first"),
               at("responses", "peer", "ttft_median_after_first"), PEER, "s"),
        *[Figure(f"hybrid-{arch}", f"tiny {arch}, 16 chats sharing a prompt: reuse",
                 at("2-shared", "ours", "reuse"), at("2-shared", "peer", "reuse"), PEER,
                 "cached/prompt") for arch in ("gemma3_text", "gpt_oss", "qwen3_5", "nemotron_h")],
    ],
    "disk": [
        Figure("restart", "a 7,000-token conversation after a restart",
               at("ttft_ours_after_restart"), at("ttft_peer_after_restart"), PEER, "s"),
        Figure("restart", "the same", at("ttft_ours_after_restart"), at("ttft_cold"),
               "ours with no cache", "s"),
        Figure("overflow-disk", "chats with RAM at a quarter of their need: warm TTFT",
               at("ours-disk", "warm_ttft_median"), at("peer", "warm_ttft_median"), PEER, "s"),
        Figure("overflow-disk", "the same", at("ours-disk", "warm_ttft_median"),
               at("ours-ram", "warm_ttft_median"), "ours with RAM enough", "s"),
    ],
    "memory": [
        Figure("multiturn", "peak RSS over the five chat workloads",
               lambda s: s["_result"]["peak_rss"]["ours"] / 2**20,
               lambda s: s["_result"]["peak_rss"]["peer"] / 2**20, PEER, "MiB"),
        Figure("models", "RSS with one model loaded", lambda s: s["ours"]["rss_one_model"] / 2**20,
               lambda s: s["peer"]["rss_one_model"] / 2**20, PEER, "MiB"),
        Figure("models", "TTFT of a model needing a load", at("ours", "cold_ttft"),
               at("peer", "cold_ttft"), PEER, "s"),
        Figure("models", "RSS after unloading one of two models",
               lambda s: s["ours_unload"]["rss_after_unload"] / 2**20,
               lambda s: s["ours_unload"]["rss_both"] / 2**20, "ours with both loaded", "MiB"),
        *[Figure("kv-bits", f"cache bytes per token, --kv-bits {b}",
                 at(f"ours --kv-bits {b}", "cache_bytes_per_token"),
                 at("ours", "cache_bytes_per_token"), "ours, float KV", "bytes") for b in (8, 4)],
    ],
    "cache library": [
        *[Figure("cache-ops", f"{what}, {n} tokens", scaled(at(i, "ours", key), key),
                 scaled(at(i, "peer", key), key),
                 "mlx-lm's LRUPromptCache", unit)
          for i, n in ((1, "8k"), (2, "32k"))
          for key, what, unit in (("lookup_ms", "lookup", "ms"), ("bytes_held", "bytes held",
                                                                  "MiB"))],
    ],
    "structured output": [
        Figure("structured", "decoding under a JSON schema", at("constrained_ms_per_token"),
               at("free_ms_per_token"), "unconstrained", "ms/token"),
        Figure("structured", "tool conversation: prompt served from the cache",
               at("tool_cached_share"), None, "", "share"),
        Figure("structured", "apply_patch calls that parsed", at("patch_parsed_share"), None,
               "", "share"),
    ],
    "images": [
        Figure("vision", f"{name}: {what}", at(family, "ours", key), at(family, "vlm", key),
               "mlx-vlm's server", "s")
        for family, name in (("gemma3", "Gemma 3"), ("qwen3_vl", "Qwen3-VL"))
        for key, what in (("cold_ttft_median", "a screenshot's first turn"),
                          ("warm_ttft_median", "the turns after it"),
                          ("second_conversation_ttft_median",
                           "the same screenshot in a new conversation"))
    ],
}
# fmt: on


# The plots workloads draw beside their results, under the question they answer.
PLOTS = {
    "TTFT": [("ttft_by_turn.png", "TTFT by turn, ours against mlx_lm.server (multiturn)")],
    "throughput": [("speculation.png", "decode tokens/s with drafts, by server (speculation)")],
    "reuse": [("reuse.png", "reuse against the ceiling, by workload (multiturn)"),
              ("agent.png", "an agent session's TTFT by turn (agent)")],
    "memory": [("memory.png", "peak RSS over the chat workloads (multiturn)")],
}  # fmt: skip


def registry() -> dict:
    spec = importlib.util.spec_from_file_location("bench_registry", ROOT / "bench" / "__main__.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.WORKLOADS


def number(x: Any) -> str:
    if isinstance(x, bool) or x is None:
        return str(x)
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def machine(result: dict) -> str:
    m = result["machine"]
    memory = f", {m['memory'] / 2**30:.0f} GiB" if m.get("memory") else ""
    return f"{m['cpu']}, {m['cores']} cores{memory}"


def commit(result: dict) -> str:
    """The commit measured, + if its tree had changes."""
    return result["commit"][:9] + ("+" if result["dirty"] else "")


def row(f: Figure, result: dict) -> str | None:
    summary = result["summary"]
    summary = {**summary, "_result": result} if isinstance(summary, dict) else summary
    if isinstance(summary, list):
        summary = {**dict(enumerate(summary)), "_result": result}
    try:
        ours = f.ours(summary) if f.ours else None
        other = f.other(summary) if f.other else None
        ratio = f.ratio(summary) if f.ratio else (ours / other if ours and other else None)
    except (KeyError, IndexError, TypeError):
        return None  # this result lacks the figure (a run of fewer servers)
    unit = f" {f.unit}" if f.unit else ""
    cells = [f.label, number(ours) + unit if ours is not None else "",
             f"{number(other)}{unit} ({f.against})" if other is not None else f.against,
             f"{ratio:.2f}x" if ratio is not None else "",
             f"`python -m bench {f.workload}`", commit(result), machine(result)]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def render() -> str:
    workloads = registry()
    out = ["# Performance", "",
           "Generated by `python tools/performance_doc.py` from the result files in "
           "[bench/results/](../bench/results/): each figure is a median of its run, its ratio "
           "the ours column over the one it is compared with (below 1: ours takes less), and "
           "the command reproduces it (the run's exact arguments are in its result file, "
           "`args`). [bench/README.md](../bench/README.md) says what each workload does.",
           ""]  # fmt: skip
    for question, figures in FIGURES.items():
        out += [f"## {question[0].upper()}{question[1:]}", "",
                "| figure | ours | compared with | ratio | command | commit | machine |",
                "|---|---|---|---|---|---|---|"]  # fmt: skip
        missing = []
        for f in figures:
            path = ROOT / "bench" / "results" / workloads[f.workload].result
            line = row(f, json.loads(path.read_text())) if path.exists() else None
            if line:
                out.append(line)
            elif f.workload not in missing:
                missing.append(f.workload)
        if len(out[-1]) and out[-1].startswith("|---"):
            out.pop(), out.pop()
        plots = [f"![{alt}](../bench/results/{name})" for name, alt in PLOTS.get(question, [])
                 if (ROOT / "bench" / "results" / name).exists()]  # fmt: skip
        out += ["", *plots] if plots else []
        if missing:
            commands = ", ".join(f"`python -m bench {w}`" for w in missing)
            out += ["" if out[-1] else None, f"No result yet: {commands}."]
        out.append("")
    return "\n".join(line for line in out if line is not None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true")
    text = render()
    if ap.parse_args().check:
        return 0 if DOC.read_text() == text else 1
    DOC.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
