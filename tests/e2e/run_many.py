"""Several train_ppo runs one after another in the same torchrun ranks:
`python -m torch.distributed.run ... tests/e2e/run_many.py RUNS.json`, where RUNS.json is a list
of {"port": P, "argv": [flags]}. Each run builds everything anew (process group, models, engine)
and closes it, as a launch of its own would; only the interpreter, and so the ~5 s of imports per
rank, is shared. Each run's process group meets at its own port, with rank 0 hosting the store:
torchrun's store keeps the keys of the groups a closed run made, under the names the next run's
groups get again, and a rank reading them would wait for peers that are gone.
Rank 0 prints `=== run i ===` before run i's output, so a test can split the output per run.

For runs whose results are compared with one another; a test about what a new process reads
from disk (resume after a kill or a preemption) launches each run on its own."""

import json
import os
import sys
from pathlib import Path

from lightrft.cli.train_ppo import parse_args, train

MARKER = "=== run {} ==="

if __name__ == "__main__":
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"
    launched = dict(os.environ)
    for index, run in enumerate(json.loads(Path(sys.argv[1]).read_text())):
        os.environ.clear()              # a run may rewrite the launcher's variables (explorer roles do)
        os.environ.update(launched, MASTER_PORT=str(run["port"]))
        if os.environ.get("RANK", "0") == "0":
            print(MARKER.format(index), flush=True)
        train(parse_args(run["argv"]))
