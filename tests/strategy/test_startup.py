"""What joining the process group costs: DeepSpeed must not JIT-build ops lightrft never calls."""

import subprocess
import sys

from tests.conftest import subprocess_env

JOIN = """
import deepspeed
from lightrft.strategy import DeepspeedStrategy, StrategyConfig
strategy = DeepspeedStrategy(StrategyConfig())
strategy.setup_distributed()
print("shm op:", deepspeed.comm.comm.cdb.shm_comm_op)
strategy.close()
"""


def test_joining_the_group_builds_no_shared_memory_op(tmp_path):
    """DeepSpeed's CPU backend would compile `deepspeed_shm_comm_op` (used only by its inference
    all-reduce) on each machine's first run, 40-85 s of a new user's first minute. With an empty
    extension cache, joining the group leaves the cache empty and the backend without the op."""
    cache = tmp_path / "torch_extensions"
    cache.mkdir()
    result = subprocess.run([sys.executable, "-c", JOIN], env=subprocess_env(TORCH_EXTENSIONS_DIR=str(cache)),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "shm op: None" in result.stdout
    assert list(cache.iterdir()) == []
