"""bench/ is one suite: every workload `python -m bench` names has its script, and
bench/results/ holds each workload's result and the plots the docs embed, nothing else."""

from __future__ import annotations

import importlib.util
import re
import sys
import tomllib
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def suite():
    spec = importlib.util.spec_from_file_location("bench_suite", BENCH / "__main__.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


# What the workloads share: servers and clients, the result envelope, multiturn.py's plots.
LIBRARY = {"__main__.py", "harness.py", "envelope.py", "plots.py"}


def test_every_workload_has_its_script_and_every_script_a_workload():
    workloads = suite().WORKLOADS
    scripts = {w.script for w in workloads.values()}
    assert all((BENCH / s).is_file() for s in scripts)
    # No script runs outside the suite.
    assert {p.name for p in BENCH.glob("*.py")} - LIBRARY == scripts


def test_every_workload_answers_one_of_the_questions():
    module = suite()
    assert {w.question for w in module.WORKLOADS.values()} == set(module.QUESTIONS)


def test_results_hold_each_workloads_file_and_the_embedded_plots_only():
    results = {w.result for w in suite().WORKLOADS.values()}
    docs = [BENCH.parent / "README.md", *BENCH.parent.glob("docs/*.md"), BENCH / "README.md"]
    embedded = {m for d in docs for m in re.findall(r"!\[[^]]*\]\([^)]*results/([^)]+)\)",
                                                     d.read_text())}  # fmt: skip
    held = {p.name for p in (BENCH / "results").iterdir()}
    assert embedded <= held, "a plot the docs embed is missing"
    assert held - embedded <= results, "not a workload's result nor an embedded plot"


def test_what_a_workload_needs_names_the_extra_that_installs_it():
    module = suite()
    pyproject = tomllib.loads((BENCH.parent / "pyproject.toml").read_text())
    assert {m for w in module.WORKLOADS.values() for m in w.needs} <= set(module.EXTRA)
    assert set(module.EXTRA.values()) <= set(pyproject["project"]["optional-dependencies"])
