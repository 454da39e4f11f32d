"""benchmarks/gpu_check.py, the one GPU command: the outcomes it reads from pytest's JUnit report,
the verdict, and the table it prints. (Its suite half is `gpu_suite.py`, whose `--smoke` run
tests/benchmarks/test_gpu_suite_smoke.py checks; the gpu tests themselves need a GPU.)"""

import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT, load_file_module, subprocess_env

PLANTED = """
import pytest

def test_passes():
    assert 1 + 1 == 2

def test_fails():
    assert 1 + 1 == 3, "arithmetic"

@pytest.mark.skip(reason="needs a CUDA GPU")
def test_skipped():
    pass
"""


@pytest.fixture(scope="module")
def gpu_check():
    return load_file_module(REPO_ROOT / "benchmarks" / "gpu_check.py")


@pytest.fixture(scope="module")
def junit(tmp_path_factory):
    root = tmp_path_factory.mktemp("planted")
    (root / "test_planted.py").write_text(PLANTED)
    report = root / "report.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                    "--rootdir", str(root), str(root / "test_planted.py")], cwd=root, env=subprocess_env(),
                   capture_output=True, text=True, timeout=120)
    return report


def test_outcomes_are_read_from_the_junit_report(gpu_check, junit):
    cases = {case["name"].split("::")[-1]: case for case in gpu_check.read_junit(junit)}
    assert {name: case["outcome"] for name, case in cases.items()} == {
        "test_passes": "passed", "test_fails": "failed", "test_skipped": "skipped"}
    assert "arithmetic" in cases["test_fails"]["message"] and cases["test_skipped"]["message"] == "needs a CUDA GPU"


def test_a_failed_test_or_section_fails_the_check_and_the_table_names_it(gpu_check, junit, capsys):
    tests = {"tests": gpu_check.read_junit(junit), "seconds": 1.0, "exit": 1}
    suite = {"figures": {"device": "NVIDIA H200", "versions": {"torch": "2.13.0"}, "failed_sections": []},
             "report": "lightrft GPU suite: x\nupdate ZeRO-2   400 TFLOP/s\nfigures written to x.json\n",
             "seconds": 2.0, "exit": 0}
    ok, problems = gpu_check.verdict(tests, suite)
    assert not ok and problems == ["1 gpu test(s) failed: test_planted::test_fails"]
    gpu_check.print_table(tests, suite, ok, problems, smoke=False)
    out = capsys.readouterr().out
    assert "NVIDIA H200; torch 2.13.0" in out and "1 passed, 1 failed, 1 skipped" in out
    assert "  update ZeRO-2   400 TFLOP/s" in out and "figures written" not in out
    assert out.rstrip().endswith("GPU check: FAIL (1 gpu test(s) failed: test_planted::test_fails)")
    passing = {"tests": [t for t in tests["tests"] if t["outcome"] != "failed"], "seconds": 1.0, "exit": 0}
    assert gpu_check.verdict(passing, suite) == (True, [])
    broken = {**suite, "exit": 1, "error": "grpo_step: RuntimeError: Expected all tensors on the same device"}
    assert gpu_check.verdict(passing, broken) == (False, ["suite: grpo_step: RuntimeError: Expected all tensors "
                                                          "on the same device"])


def test_only_modules_with_gpu_tests_are_collected(gpu_check):
    """A module that cannot be imported on the GPU machine (the OpenAI client is not there) must not
    stop the gpu tests: only modules holding them are passed to pytest."""
    files = gpu_check.gpu_test_files()
    assert {"tests/strategy/test_strategy_dist.py", "tests/models/test_packing_gpu.py",
            "tests/algorithms/test_logprobs_gpu.py"} <= set(files)
    assert "tests/serving/test_http.py" not in files and "tests/cli/test_serve.py" not in files
