"""The result envelope: what a result file says about how its figures were measured, and
where results and raw records go.

Every file a workload writes to bench/results/ is one JSON object with the fields of
FIELDS: the workload, the commit and whether the tree had uncommitted changes, the
machine (CPU model, cores, memory, OS), the versions of MLX, mlx-lm and Python, the
arguments, when it started and how long it ran, the servers compared (kind and command
line) and `summary`, the figures the docs show. Raw per-request records go to a file
outside the repository (`raw_dir()`), named in the envelope's `raw`; a result stays a
summary, under MAX_BYTES.

Environment, set by `python -m bench`: BENCH_WORKLOAD (the workload's name),
BENCH_QUICK=1 (a short run: its result goes beside the raw records, not to
bench/results/), BENCH_RAW_DIR (where raw records go).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
MAX_BYTES = 50 * 1024
FIELDS = ("workload", "commit", "dirty", "machine", "mlx", "mlx_lm", "python", "args",
          "started", "duration", "servers", "summary")  # fmt: skip
MACHINE_FIELDS = ("cpu", "cores", "memory", "os")


def quick() -> bool:
    """Whether this run is a short check of the harness (`python -m bench NAME --quick`)."""
    return os.environ.get("BENCH_QUICK") == "1"


def raw_dir() -> Path:
    """Where raw per-request records go: outside the repository unless asked otherwise."""
    default = Path(tempfile.gettempdir()) / "mlx-cache-server-bench"
    return Path(os.environ.get("BENCH_RAW_DIR") or default)


def _git(*args: str, cwd: Path = ROOT) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def commit(tree: Path = ROOT) -> tuple[str | None, bool | None]:
    """(commit, dirty) of `tree`; dirty ignores bench/results/, which a run writes."""
    head = _git("rev-parse", "HEAD", cwd=tree)
    status = _git("status", "--porcelain", "--", ".", ":(exclude)bench/results", cwd=tree)
    return head, (bool(status) if status is not None else None)


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    if sys.platform == "darwin":
        out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"],
                             capture_output=True, text=True)  # fmt: skip
        return out.stdout.strip() or None
    return platform.processor() or None


def _memory() -> int | None:
    """Total memory in bytes."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def machine() -> dict[str, Any]:
    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "memory": _memory(),
            "os": platform.platform()}  # fmt: skip


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _plain(value: Any) -> Any:
    """Arguments as JSON: paths and other objects as their text."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def servers_of(kinds: dict[str, list[str]]) -> dict[str, dict[str, Any]]:
    """Each server compared: its command line and, for ours at another checkout, that
    checkout's commit."""
    out = {}
    for kind, cmd in kinds.items():
        entry: dict[str, Any] = {"command": " ".join(cmd)}
        if kind.startswith("ours@"):
            entry["commit"], entry["dirty"] = commit(Path(kind.partition("@")[2]))
        out[kind] = entry
    return out


def envelope(
    workload: str,
    args: dict[str, Any],
    started: float,
    summary: Any,
    servers: dict[str, list[str]] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A result: `summary` with the fields of FIELDS around it. `started` is a time.time();
    `servers` maps each kind compared to its command line; `extra` holds further figures."""
    head, dirty = commit()
    return {
        "workload": workload,
        "commit": head,
        "dirty": dirty,
        "machine": machine(),
        "mlx": _version("mlx"),
        "mlx_lm": _version("mlx-lm"),
        "python": platform.python_version(),
        "args": _plain(args),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "duration": round(time.time() - started, 1),
        "servers": servers_of(servers or {}),
        "summary": _plain(summary),
        **_plain(extra),
    }


def write_result(
    name: str,
    args: Any,
    started: float,
    summary: Any,
    raw: Any = None,
    servers: dict[str, list[str]] | None = None,
    folder: Path = RESULTS,
    **extra: Any,
) -> Path:
    """Write the result file `name` (in `folder`, or beside the raw records on a quick run:
    `python -m bench NAME --quick`, or a script's own --quick) and `raw`, when given, to
    raw_dir(). `args` is argparse's namespace or a dict. Returns the result's path."""
    from harness import STARTED  # the servers this process started, when not given

    workload = os.environ.get("BENCH_WORKLOAD") or Path(name).stem
    args = vars(args) if hasattr(args, "__dict__") else dict(args or {})
    out = envelope(workload, args, started, summary, servers or STARTED, **extra)
    stem = Path(name).stem
    if raw is not None:
        raw_path = raw_dir() / f"{stem}.raw.json"
        raw_path.parent.mkdir(parents=True, exist_ok=True)
        raw_path.write_text(json.dumps(_plain(raw)))
        out["raw"] = f"{raw_path.name} (written outside the repository: BENCH_RAW_DIR)"
    short = quick() or args.get("quick") is True
    path = (raw_dir() / "quick" if short else folder) / f"{stem}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}" + (f" and {raw_path}" if raw is not None else ""), flush=True)
    return path


def read_raw(name: str) -> Any:
    """The raw records a run of `name` wrote (for a script's --report)."""
    return json.loads((raw_dir() / f"{Path(name).stem}.raw.json").read_text())
