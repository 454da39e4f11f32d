"""Several train_ppo (or train_sft) runs one after another in the same torchrun ranks:
`python -m torch.distributed.run ... tests/e2e/run_many.py RUNS.json`, where RUNS.json is a list
of {"port": P, "argv": [flags], "env": {NAME: VALUE}, "cli": "train_ppo"} ("env": variables set
for that run only, such as a fault-injection plan; "cli": the `lightrft.cli` command whose
`train(parse_args(argv))` runs, train_ppo unless named). Each run builds everything anew
(process group, models, engine) and closes it, as a launch of its own would; only the
interpreter, and so the ~5 s of imports per rank, is shared. Each run's process group meets at
its own port, with rank 0 hosting the store: torchrun's store keeps the keys of the groups a
closed run made, under the names the next run's groups get again, and a rank reading them would
wait for peers that are gone.
Rank 0 prints `=== run i ===` before run i's output, so a test can split the output per run.

For runs whose results are compared with one another; a test about what a new process reads
from disk (resume after a kill or a preemption) launches each run on its own."""

import importlib
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

from torch.distributed import TCPStore

from lightrft.utils.program import finish_process

MARKER = "=== run {} ==="


def all_arrived(store, key: str, world: int) -> None:
    """Waits on torchrun's own store (it outlives every rank) until all `world` ranks got here."""
    store.add(key, 1)
    while int(store.add(key, 0)) < world:
        time.sleep(0.05)


if __name__ == "__main__":
    launched = dict(os.environ)
    world = int(launched["WORLD_SIZE"])
    agent = TCPStore(launched["MASTER_ADDR"], int(launched["MASTER_PORT"]), world, is_master=False,
                     timeout=timedelta(minutes=10))
    for index, run in enumerate(json.loads(Path(sys.argv[1]).read_text())):
        os.environ.clear()              # a run may rewrite the launcher's variables (explorer roles do)
        os.environ.update(launched, MASTER_PORT=str(run["port"]), TORCHELASTIC_USE_AGENT_STORE="False")
        os.environ.update(run.get("env", {}))
        if launched["RANK"] == "0":
            print(f"\n{MARKER.format(index)}", flush=True)   # on a line of its own, whatever came before
        command = importlib.import_module(f"lightrft.cli.{run.get('cli', 'train_ppo')}")
        command.train(command.parse_args(run["argv"]))
        # Rank 0 hosts the run's store: no rank leaves (or starts the next run) while a peer may
        # still be closing its groups over it.
        all_arrived(agent, f"run_many/after/{index}", world)
    # Every run has closed its groups and written its files; end as train_ppo's own __main__ does.
    finish_process(0)
