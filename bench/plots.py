"""multiturn.py's plots, which the docs embed: TTFT by turn, reuse against the ceiling,
and each server's peak memory."""

from __future__ import annotations

import statistics
from pathlib import Path

from harness import Server


def plot(summary: dict, servers: dict[str, Server], path: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    files = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, w in zip(axes, ("1-sequential", "2-shared"), strict=True):
        for kind, s in servers.items():
            turns = sorted({c.turn for c in s.calls if c.workload == w})
            med = [
                statistics.median(c.ttft for c in s.calls if c.workload == w and c.turn == t)
                for t in turns
            ]
            ax.plot(turns, med, marker="o", label=kind)
        ax.set_title(f"workload {w}: TTFT by turn (median)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("turn")
        ax.set_ylabel("seconds")
        ax.legend()
    fig.tight_layout()
    files.append(path / "ttft_by_turn.png")
    fig.savefig(files[-1], dpi=110)

    fig, ax = plt.subplots(figsize=(9, 4))
    workloads = list(summary)
    kinds = [k for k in servers if k != "ours-nocache"]
    width = 0.8 / (len(kinds) + 1)
    for i, kind in enumerate(kinds):
        ax.bar(
            [j + i * width for j in range(len(workloads))],
            [summary[w][kind]["reuse"] for w in workloads],
            width,
            label=f"{kind} reuse",
        )
    ax.bar(
        [j + len(kinds) * width for j in range(len(workloads))],
        [summary[w]["ours"]["ceiling"] for w in workloads],
        width,
        label="ceiling",
        color="grey",
    )
    ax.set_xticks([j + width for j in range(len(workloads))], workloads)
    ax.set_ylabel("cached / prompt tokens")
    ax.set_title("Reuse against the ceiling")
    ax.legend()
    fig.tight_layout()
    files.append(path / "reuse.png")
    fig.savefig(files[-1], dpi=110)

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(list(servers), [s.peak_rss / 2**20 for s in servers.values()])
    ax.set_ylabel("peak RSS (MiB)")
    ax.set_title("Server memory over the whole run")
    fig.tight_layout()
    files.append(path / "memory.png")
    fig.savefig(files[-1], dpi=110)
    plt.close("all")
    return files
