import subprocess
import sys

from tests.conftest import REPO_ROOT


def test_algorithms_import_torch_only():
    code = (
        "import sys, lightrft.algorithms, lightrft.models.loss, lightrft.models.utils; "
        "heavy = sorted(m for m in ('transformers', 'deepspeed', 'vllm', 'peft') if m in sys.modules); "
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
