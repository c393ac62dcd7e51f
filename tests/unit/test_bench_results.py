"""Every result the suite keeps says how it was measured and stays a summary: the envelope's
fields (bench/envelope.py) around its figures, under the size bound; and the envelope a run
writes has those fields, its raw records outside the repository."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULT_FILES = sorted([*(ROOT / "bench" / "results").glob("*.json"),
                       *(ROOT / "examples" / "results").glob("*.json")])  # fmt: skip


@pytest.fixture
def envelope(bench_script):
    return bench_script("envelope")


def test_there_are_results():
    assert len(RESULT_FILES) > 10


@pytest.mark.parametrize("path", RESULT_FILES, ids=lambda p: p.name)
def test_each_result_carries_the_envelope_and_stays_small(path, envelope):
    assert path.stat().st_size < envelope.MAX_BYTES, "raw records belong outside the repo"
    result = json.loads(path.read_text())
    missing = [f for f in envelope.FIELDS if f not in result]
    assert not missing, f"{path.name} lacks {missing}"
    assert set(envelope.MACHINE_FIELDS) <= set(result["machine"])
    assert result["summary"], "a result holds figures"
    if path.parent.parent.name == "bench":  # a benchmark's figure names what measured it
        assert len(result["commit"]) == 40 and isinstance(result["dirty"], bool)
        assert result["machine"]["cpu"] and result["machine"]["cores"]
    elif result["commit"] is None:  # an example's provenance not known is said so
        assert result.get("note")


def test_the_envelope_has_every_field(envelope):
    result = envelope.envelope("decode", {"rounds": 1, "out": Path("x.json")}, 0.0,
                               {"ours": {"tokens_per_s": 1.0}},
                               {"ours": ["python", "-m", "mlx_cache_server", "serve"]})  # fmt: skip
    assert set(envelope.FIELDS) <= set(result)
    assert set(envelope.MACHINE_FIELDS) == set(result["machine"])
    assert result["workload"] == "decode"
    assert result["commit"] is None or len(result["commit"]) == 40
    assert isinstance(result["machine"]["cores"], int)
    assert result["args"] == {"rounds": 1, "out": "x.json"}
    assert result["servers"]["ours"]["command"] == "python -m mlx_cache_server serve"
    assert result["mlx"] and result["mlx_lm"] and result["python"]
    json.dumps(result)  # plain JSON all through


def test_a_quick_run_writes_outside_the_results_and_raw_records_apart(
    envelope, tmp_path, monkeypatch
):
    monkeypatch.setenv("BENCH_QUICK", "1")
    monkeypatch.setenv("BENCH_RAW_DIR", str(tmp_path))
    monkeypatch.setenv("BENCH_WORKLOAD", "decode")
    path = envelope.write_result("decode.json", {"rounds": 1}, 0.0, {"ours": 1.0},
                                 raw={"calls": [1, 2, 3]}, servers={})  # fmt: skip
    assert path == tmp_path / "quick" / "decode.json"
    result = json.loads(path.read_text())
    assert result["workload"] == "decode" and "calls" not in json.dumps(result["summary"])
    assert json.loads((tmp_path / "decode.raw.json").read_text()) == {"calls": [1, 2, 3]}
    assert envelope.read_raw("decode") == {"calls": [1, 2, 3]}


def test_the_performance_doc_is_what_the_results_give():
    """docs/performance.md holds only figures the results hold: tools/performance_doc.py
    writes it, and a result changed without it is caught here."""
    path = ROOT / "tools" / "performance_doc.py"
    spec = importlib.util.spec_from_file_location("performance_doc", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    assert (ROOT / "docs" / "performance.md").read_text() == module.render(), (
        "run python tools/performance_doc.py"
    )


def test_a_scripts_own_quick_run_stays_out_of_the_results(envelope, tmp_path, monkeypatch):
    monkeypatch.delenv("BENCH_QUICK", raising=False)
    monkeypatch.setenv("BENCH_RAW_DIR", str(tmp_path))
    path = envelope.write_result("kv_bits_quick.json", {"quick": True}, 0.0, {"ours": 1.0},
                                 servers={})  # fmt: skip
    assert path == tmp_path / "quick" / "kv_bits_quick.json"
