"""train_ppo under torchrun with a callback that writes, after every rollout, what the rollout
manager synced: `python -m torch.distributed.run ... tests/e2e/run_with_sync_log.py LOG.jsonl <train_ppo flags>`.
Rank 0 appends one JSON line per step."""

import json
import sys

from lightrft.cli.train_ppo import parse_args, train
from lightrft.trainer.callbacks import TrainerCallback
from lightrft.utils.program import run_program


class SyncLog(TrainerCallback):
    def __init__(self, path: str):
        self.path = path

    def on_rollout_end(self, trainer, experiences) -> None:
        manager, module = trainer.rollout, trainer.strategy.unwrap_model(trainer.actor)
        sizes = {name: getattr(p, "ds_numel", p.numel()) * p.element_size() for name, p in module.named_parameters()}
        adapter = getattr(manager.engine, "adapter", None)
        row = {"syncs": manager.syncs, "sync_bytes": manager.last_sync_bytes, "model_bytes": sum(sizes.values()),
               "lora_bytes": sum(v for k, v in sizes.items() if ".lora_" in k),
               "adapter_id": adapter.lora_int_id if adapter is not None else None,
               "replica": manager.replica.ranks if manager.replica is not None else None}
        if trainer.strategy.rank == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    run_program(train, parse_args(sys.argv[2:]), callbacks=[SyncLog(sys.argv[1])])
