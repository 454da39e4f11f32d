"""The suite's deprecation check (tests/deprecations.py, wired in tests/conftest.py): a deprecated
call made by lightrft code fails a test, one made by other code does not. The deprecated call is
the real one: a `past_key_values` argument to a forward that takes `cache`, which transformers'
`deprecate_kwarg` reports with a stacklevel pointing into `torch.nn.Module.__call__`."""

import importlib.util
import subprocess
import sys

import pytest
import torch

from lightrft.rollout import HFEngine, SamplingParams
from lightrft.utils.tiny import build_tiny_arch, tiny_tokenizer
from tests.conftest import REPO_ROOT, subprocess_env
from tests.deprecations import LightrftDeprecations
from tests.rollout.test_hf_engine import RenamedCacheLM


@pytest.fixture(scope="module")
def renamed_lm():
    tokenizer = tiny_tokenizer("llama")
    return tokenizer, RenamedCacheLM(build_tiny_arch("llama", tokenizer).eval())


def test_a_deprecated_call_from_lightrft_code_is_found(renamed_lm):
    tokenizer, model = renamed_lm
    engine = HFEngine(model, tokenizer.pad_token_id, tokenizer.eos_token_id)
    engine._cache_name = "past_key_values"      # the name HFEngine passed before it read the signature
    with LightrftDeprecations() as check:
        engine.generate([tokenizer.encode("1+1=")], SamplingParams(max_new_tokens=2, seed=0))
    assert check.found
    assert all(f.startswith("FutureWarning from lightrft code at ") for f in check.found)
    assert all(f"{REPO_ROOT / 'lightrft' / 'rollout' / 'hf_engine.py'}:" in f for f in check.found)
    assert "`past_key_values` is deprecated" in check.found[0]


THIRD_PARTY = """
def forward_with_old_name(model, input_ids):
    return model(input_ids=input_ids, past_key_values=None, use_cache=True)
"""


def test_a_deprecated_call_from_other_code_is_passed_on(renamed_lm, tmp_path):
    tokenizer, model = renamed_lm
    (tmp_path / "other_package.py").write_text(THIRD_PARTY)
    spec = importlib.util.spec_from_file_location("other_package", tmp_path / "other_package.py")
    other = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(other)
    with pytest.warns(FutureWarning, match="past_key_values") as passed_on:
        with LightrftDeprecations() as check:
            other.forward_with_old_name(model, torch.tensor([tokenizer.encode("1+1=")]))
    assert check.found == []
    assert [w.filename for w in passed_on] and all(w.category is FutureWarning for w in passed_on)


PLANTED_TEST = """
from lightrft.rollout import HFEngine, SamplingParams
from lightrft.utils.tiny import build_tiny_arch, tiny_tokenizer
from tests.rollout.test_hf_engine import RenamedCacheLM


def test_planted():
    tokenizer = tiny_tokenizer("llama")
    engine = HFEngine(RenamedCacheLM(build_tiny_arch("llama", tokenizer).eval()), tokenizer.pad_token_id,
                      tokenizer.eos_token_id)
    engine._cache_name = "past_key_values"
    engine.generate([tokenizer.encode("1+1=")], SamplingParams(max_new_tokens=2, seed=0))
"""


def test_the_suite_fails_a_test_whose_lightrft_code_makes_a_deprecated_call(tmp_path):
    (tmp_path / "test_planted.py").write_text(PLANTED_TEST)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-c", str(REPO_ROOT / "pytest.ini"), "-p", "tests.conftest",
                           "-n", "0",
                           "--rootdir", str(REPO_ROOT), "-q", str(tmp_path / "test_planted.py")],
                          cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "lightrft code made deprecated calls during the test of" in proc.stdout
    assert "rollout/hf_engine.py" in proc.stdout and "1 failed" in proc.stdout
