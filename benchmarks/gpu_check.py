"""The one GPU command: the `gpu`-marked tests and the GPU suite on one CUDA device, one table.

    python benchmarks/gpu_check.py                       # about 10 minutes on one H100/H200
    python benchmarks/gpu_check.py --json gpu_check.json # also the figures and outcomes as JSON
    python benchmarks/gpu_check.py --smoke               # the CPU check of this script (CI): the gpu
                                                         # tests are skipped there, the suite runs --smoke

Runs, each in its own process with its own time limit (so one hang cannot eat the other's time):
1. `pytest -m gpu` over the modules that hold gpu tests (NCCL and bf16 training, packed attention kernels, log-prob kernels),
   every test's outcome and duration read from pytest's JUnit XML report;
2. `benchmarks/gpu_suite.py` (actor update TFLOP/s and MFU under ZeRO-2/3, HF and vLLM rollout
   tokens/s, weight-sync seconds per GB, one GRPO step with its phase split), with the sizes
   `--suite_args` gives (default: fewer timed repeats than the suite's own, to fit the budget).

Then prints one table: the card, the versions, each test's outcome, each suite figure, and a
verdict line (`GPU check: PASS` or `GPU check: FAIL (...)`); exit status 0 on PASS, 1 otherwise.
Needs what the tests and the suite need (torch with CUDA, transformers, deepspeed, datasets,
pytest); vLLM and flash-attn are used when installed.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# Fewer timed repeats than the suite's defaults: the tests and the suite fit in 10 minutes together.
DEFAULT_SUITE_ARGS = ["--update_steps", "2", "--repeats", "2", "--profile", "--wide_micro_tokens", "32768",
                      "--shared_prompts", "8", "--compile_layers", "--hf_static"]


def gpu_test_files() -> list[str]:
    """The test modules that hold `gpu`-marked tests. Only these are collected: the rest of the suite
    imports what a GPU machine may lack (the OpenAI client, vLLM), and one module that fails to
    import stops pytest's collection, the gpu tests with it."""
    return sorted(str(path.relative_to(REPO_ROOT)) for path in (REPO_ROOT / "tests").rglob("test_*.py")
                  if "pytest.mark.gpu" in path.read_text(encoding="utf-8"))


def run_gpu_tests(report: Path, timeout: float, smoke: bool) -> dict:
    """`pytest -m gpu` with a JUnit report; {"tests": [...], "seconds", "exit", "error"?}."""
    # `-o addopts=` drops pytest.ini's `-n 2` (pytest-xdist): the GPU tests run one at a time, on
    # machines that may not have the test extras.
    cmd = [sys.executable, "-m", "pytest", "-o", "addopts=", "-m", "gpu", "-q", "-p", "no:cacheprovider",
           "--strict-markers", f"--junitxml={report}",
           *gpu_test_files()]
    env = dict(os.environ)
    if smoke:
        env["CUDA_VISIBLE_DEVICES"] = ""
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"tests": [], "seconds": timeout, "exit": None, "error": f"the gpu tests ran past {timeout:.0f} s"}
    result = {"tests": read_junit(report) if report.exists() else [], "seconds": time.perf_counter() - started,
              "exit": proc.returncode}
    if proc.returncode not in (0, 5):       # 5: no test collected (none selected)
        result["error"] = proc.stdout[-3000:] + proc.stderr[-2000:]
    return result


def read_junit(path: Path) -> list[dict]:
    """Each test case of a JUnit XML report: name, outcome (passed/failed/error/skipped), seconds, message."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                message = (child.get("message") or "").splitlines()[0][:160] if child.get("message") else ""
        cases.append({"name": f"{case.get('classname', '')}::{case.get('name', '')}", "outcome": outcome,
                      "seconds": float(case.get("time") or 0.0), "message": message})
    return cases


def run_suite(json_path: Path, timeout: float, smoke: bool, suite_args: list[str]) -> dict:
    """`gpu_suite.py` with `--json`; {"figures": {...}, "report": text, "seconds", "exit", "error"?}."""
    cmd = [sys.executable, str(REPO_ROOT / "benchmarks" / "gpu_suite.py"), "--json", str(json_path), *suite_args]
    if smoke:
        cmd.append("--smoke")
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"figures": {}, "report": "", "seconds": timeout, "exit": None,
                "error": f"the suite ran past {timeout:.0f} s"}
    figures = json.loads(json_path.read_text()) if json_path.exists() else {}
    start = proc.stdout.rfind("lightrft GPU suite")
    result = {"figures": figures, "report": proc.stdout[start:] if start >= 0 else "",
              "seconds": time.perf_counter() - started, "exit": proc.returncode}
    if proc.returncode != 0:
        result["error"] = (", ".join(figures.get("failed_sections", [])) or proc.stderr[-2000:] or proc.stdout[-2000:])
    return result


def verdict(tests: dict, suite: dict) -> tuple[bool, list[str]]:
    problems = []
    failed = [t["name"] for t in tests["tests"] if t["outcome"] in ("failed", "error")]
    if failed:
        problems.append(f"{len(failed)} gpu test(s) failed: {', '.join(failed)}")
    if "error" in tests and not failed:
        problems.append("the gpu tests did not run: " + tests["error"].strip().splitlines()[-1][:200])
    if "error" in suite:
        problems.append("suite: " + str(suite["error"]).strip().splitlines()[-1][:200])
    return not problems, problems


def print_table(tests: dict, suite: dict, ok: bool, problems: list[str], smoke: bool) -> None:
    figures = suite["figures"]
    versions = figures.get("versions", {})
    print()
    print(f"lightrft GPU check{' (smoke, CPU)' if smoke else ''}: {figures.get('device', '?')}; "
          + ", ".join(f"{name} {version}" for name, version in versions.items()))
    counts = {outcome: sum(t["outcome"] == outcome for t in tests["tests"])
              for outcome in ("passed", "failed", "error", "skipped")}
    print(f"gpu tests: {counts['passed']} passed, {counts['failed'] + counts['error']} failed, "
          f"{counts['skipped']} skipped in {tests['seconds']:.0f} s")
    for test in tests["tests"]:
        note = f"  ({test['message']})" if test["message"] and test["outcome"] != "passed" else ""
        print(f"  {test['outcome']:<8} {test['seconds']:7.1f} s  {test['name']}{note}")
    print(f"suite ({suite['seconds']:.0f} s):")
    for line in suite["report"].splitlines()[1:]:
        if line.startswith("figures written to"):
            continue
        print(f"  {line}")
    print(f"GPU check: {'PASS' if ok else 'FAIL (' + '; '.join(problems) + ')'}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None, help="write the outcomes and figures here")
    parser.add_argument("--smoke", action="store_true", help="CPU check of this script: gpu tests skip, suite --smoke")
    parser.add_argument("--tests_timeout", type=float, default=240.0, help="seconds for the gpu tests")
    parser.add_argument("--suite_timeout", type=float, default=400.0, help="seconds for the suite")
    parser.add_argument("--suite_args", default=" ".join(DEFAULT_SUITE_ARGS),
                        help="arguments for benchmarks/gpu_suite.py, as one string")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        tests = run_gpu_tests(Path(tmp) / "gpu_tests.xml", args.tests_timeout, args.smoke)
        suite = run_suite(Path(tmp) / "suite.json", args.suite_timeout, args.smoke, args.suite_args.split())
    ok, problems = verdict(tests, suite)
    print_table(tests, suite, ok, problems, args.smoke)
    if args.json:
        Path(args.json).write_text(json.dumps({"ok": ok, "problems": problems, "tests": tests,
                                               "suite": {k: v for k, v in suite.items() if k != "report"}}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
