"""bench/gpu_check and bench/bench_gpu.py where no GPU is: the benchmark says CUDA is absent (in its JSON
too), a step past its time-out is stopped with what it started, and the report reads test outcomes from
pytest's junit XML or, for a run stopped before writing it, from its verbose lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from importlib.machinery import SourceFileLoader
from importlib.util import module_from_spec, spec_from_loader
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
_loader = SourceFileLoader("gpu_check", str(BENCH / "gpu_check"))  # a script: no .py to import it by
gpu_check = module_from_spec(spec_from_loader("gpu_check", _loader))
_loader.exec_module(gpu_check)

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.e2e.test_regions_e2e" name="test_round_trip" time="1.5"/>
<testcase classname="tests.e2e.test_regions_e2e" name="test_cuda_round_trip" time="0.0">
<skipped type="pytest.skip" message="CUDA is not available on this machine">skip</skipped></testcase>
<testcase classname="tests.engine.test_regions" name="test_describe" time="0.2">
<failure message="AssertionError: 3 != 4">def test_describe(): assert 3 == 4</failure></testcase>
</testsuite></testsuites>"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: bench_gpu.py would run in full")
def test_bench_gpu_without_cuda_says_so_and_exits_0(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    p = subprocess.run(
        [sys.executable, str(BENCH / "bench_gpu.py"), "--budget-s", "5", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert "CUDA is not available" in p.stdout
    doc = json.loads(out.read_text())
    assert doc["cuda"] is False and doc["cases"] == []
    assert doc["environment"]["torch"] == torch.__version__


def test_a_step_past_its_time_out_is_stopped_with_what_it_started(tmp_path: Path) -> None:
    log = tmp_path / "step.log"
    t0 = time.monotonic()
    rc, out, _ = gpu_check.run(["sh", "-c", "sleep 60 & echo $!; wait"], 1.0, log)
    assert rc is None and time.monotonic() - t0 < 10
    child = int(out.split()[0])
    stat = Path(f"/proc/{child}/stat")

    def ended() -> bool:  # killed: gone, or a zombie its new parent has not reaped yet
        try:
            return stat.read_text().split(") ")[1].startswith("Z")
        except (FileNotFoundError, ProcessLookupError):
            return True

    # SIGKILL lands asynchronously: the process may still run for a moment on its way out (CI saw "R").
    deadline = time.monotonic() + 10
    while not ended() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ended(), f"the step's child {child} outlived its time-out"
    assert "[exit TIME-OUT" in log.read_text()
    assert gpu_check.run(["true"], 10)[0] == 0
    assert gpu_check.run([os.devnull], 10)[0] != 0


def test_the_report_reads_outcomes_from_junit_or_from_verbose_lines(tmp_path: Path) -> None:
    junit = tmp_path / "junit.xml"
    junit.write_text(JUNIT)
    cases = gpu_check.parse_junit(junit)
    assert [c["outcome"] for c in cases] == ["passed", "skipped", "failed"]
    assert cases[1]["message"] == "CUDA is not available on this machine"
    assert "AssertionError: 3 != 4" in cases[2]["message"] and "assert 3 == 4" in cases[2]["message"]
    verbose = "tests/a.py::test_x PASSED [ 50%]\ntests/a.py::test_y FAILED [100%]\nnoise\n"
    assert [(c["id"], c["outcome"]) for c in gpu_check.parse_verbose(verbose)] == [
        ("tests/a.py::test_x", "passed"),
        ("tests/a.py::test_y", "failed"),
    ]
    doc = {
        "ok": False,
        "seconds": 12.0,
        "environment": {"cuda_available": False},
        "steps": {"tests": {"cases": cases, "counts": {"passed": 1, "skipped": 1, "failed": 1}}},
        "failed": ["test tests.engine.test_regions::test_describe: failed"],
        "not_run": ["everything that needs CUDA: CUDA is absent on this machine"],
    }
    text = gpu_check.text_report(doc)
    assert text.startswith("hicached gpu_check: FAIL")
    assert "FAILED   tests.engine.test_regions::test_describe" in text
    assert "CUDA is absent on this machine" in text.split("Could not run")[1]
