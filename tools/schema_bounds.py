"""How deep a JSON schema llguidance can compile before its native stack overflows.

For each construct (a `$ref` chain, nested objects, nested arrays, nested
`anyOf`), bisects the number of levels at which compiling it (conversion,
validation and a matcher over the tiny test tokenizer, as the server does)
kills a child process on a thread with a given stack; then reports the stack
each level takes, what the deepest schema the server admits
(`schema_bounds.MAX_DEPTH`) would need, and the margin `constraint.DEEP_STACK`
leaves. Also times the server's whole check and compile of the largest admitted
schemas. No server is started.

    python tools/schema_bounds.py [--stack-mib 8]   # writes tools/schema_bounds.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "tools"


def chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def objects(n: int) -> dict:
    """Nested objects as a `$ref` chain: plain nesting stops at llguidance's JSON reader."""
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}},
                      "required": ["a"]} for i in range(n)}  # fmt: skip
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def arrays(n: int) -> dict:
    defs = {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def any_of(n: int) -> dict:
    defs = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"type": "integer"}]}
            for i in range(n)}  # fmt: skip
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


CONSTRUCTS = {"chain": chain, "objects": objects, "arrays": arrays, "anyOf": any_of}


def compile_raw(schema: dict) -> None:
    """What the server runs on a schema, without its bounds."""
    import llguidance
    from transformers import PreTrainedTokenizerFast

    from tests.tiny_model import build_tokenizer

    hf = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer())
    tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=len(hf), eos_token=0)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
    llguidance.LLMatcher(tokenizer, grammar)


def child(construct: str, levels: int, stack_kib: int) -> None:
    import llguidance.hf  # noqa: F401 (before the thread: imports are not what is measured)

    threading.stack_size(stack_kib * 1024)
    thread = threading.Thread(target=compile_raw, args=(CONSTRUCTS[construct](levels),))
    thread.start()
    thread.join()
    print("compiled", flush=True)
    # Skip the interpreter's teardown: native libraries' exit-time destructors sometimes
    # abort ("terminate called without an active exception"), which is not the compile.
    os._exit(0)


def survives(construct: str, levels: int, stack_kib: int) -> bool:
    cmd = [sys.executable, __file__, "--child", construct, str(levels), str(stack_kib)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return "compiled" in run.stdout


def overflow_at(construct: str, stack_kib: int) -> int:
    """The least number of levels that overflows, to within 2%."""
    lo, hi = 1, 64
    while survives(construct, hi, stack_kib):
        lo, hi = hi, hi * 2
    while hi - lo > max(1, lo // 50):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if survives(construct, mid, stack_kib) else (lo, mid)
    return hi


def admitted_cost() -> dict:
    """Seconds the server's check and compile take on the largest schemas it admits."""
    from mlx_cache_server.engine.constraint import DEEP_STACK
    from mlx_cache_server.serving import schema_bounds as bounds
    from mlx_cache_server.serving.structured import json_grammar

    depth = bounds.MAX_DEPTH - 2
    wide = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"const": i}}} for i in
                      range(bounds.MAX_NODES // 3)]}  # fmt: skip
    out = {"deep_stack_bytes": DEEP_STACK}
    for name, schema in [("chain", chain(depth)), ("objects", objects(depth // 2)), ("wide", wide)]:
        t0 = time.perf_counter()
        json_grammar(schema, "bench")
        out[f"{name}_seconds"] = round(time.perf_counter() - t0, 3)
    return out


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--stack-mib", type=int, default=8)
    args = ap.parse_args()
    from mlx_cache_server.engine.constraint import DEEP_STACK
    from mlx_cache_server.serving.schema_bounds import MAX_DEPTH

    stack = args.stack_mib * 1024**2
    rows = {}
    for name in CONSTRUCTS:
        levels = overflow_at(name, stack // 1024)
        per_level = stack / levels
        rows[name] = {
            "overflows_at_levels": levels,
            "stack_bytes_per_level": round(per_level),
            "deep_stack_margin_at_max_depth": round(DEEP_STACK / (per_level * MAX_DEPTH), 1),
        }
        print(name, rows[name], flush=True)
    result = {"stack_bytes": stack, "max_depth": MAX_DEPTH, "constructs": rows,
              "admitted": admitted_cost()}  # fmt: skip
    print(json.dumps(result["admitted"]))
    (RESULTS / "schema_bounds.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
