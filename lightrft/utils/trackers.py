"""Metric trackers: Weights & Biases and TensorBoard behind one small object.

Only rank 0 writes. wandb and tensorboard are imported when asked for, so a run that uses
neither never imports them. W&B offline mode (`--use_wandb offline`) writes a run folder with no
network access; `wandb sync` uploads it later.
"""

import html
import os
from typing import Mapping, Sequence

from lightrft.utils.secrets import redact_options, redact_text

# Kept names: the redaction itself lives in lightrft.utils.secrets, shared by every writer of options.
redact = redact_text


def redacted_config(config: Mapping) -> dict:
    """A copy of a run config that is safe to log: secrets masked, URLs stripped of credentials."""
    return redact_options(config)


def _markdown_cell(value) -> str:
    text = f"{value:.6g}" if isinstance(value, float) else str(value)
    # Model text may hold anything: HTML is escaped (TensorBoard renders markdown as HTML), a pipe
    # would end the cell and a newline the row (<br> keeps a multi-line response on one row).
    text = html.escape(text, quote=False).replace("\\", "\\\\").replace("|", "\\|")
    return text.replace("\r\n", "\n").replace("\n", "<br>")


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A GitHub-flavoured markdown table; cells are escaped so any text stays in its cell."""
    lines = ["| " + " | ".join(_markdown_cell(c) for c in columns) + " |",
             "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_markdown_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


class MetricsTracker:
    """Writes scalar metrics to W&B and/or TensorBoard on rank 0; a no-op on other ranks.

    `use_wandb`: None (off), "offline", "online", or an API key. `use_tensorboard`: a folder or None.
    Metric names carry their namespace (`rollout/reward`, `train/policy_loss`, ...)."""

    def __init__(self, *, is_rank_0: bool, config: Mapping, use_wandb: str | None = None,
                 wandb_project: str = "lightrft", wandb_org: str | None = None,
                 wandb_run_name: str | None = None, use_tensorboard: str | None = None,
                 wandb_dir: str | None = None):
        self._wandb = None
        self._tb = None
        if not is_rank_0:
            return
        config = redacted_config(config)
        if use_wandb:
            import wandb

            if use_wandb not in ("offline", "online"):
                wandb.login(key=use_wandb)
            mode = "offline" if use_wandb == "offline" else None
            self._wandb = wandb.init(project=wandb_project, entity=wandb_org, name=wandb_run_name,
                                     config=config, mode=mode, dir=wandb_dir, reinit="finish_previous")
        if use_tensorboard:
            from tensorboard.compat.proto.summary_pb2 import Summary
            from torch.utils.tensorboard import SummaryWriter
            from torch.utils.tensorboard.summary import scalar

            self._tb_summary, self._tb_scalar = Summary, scalar

            os.makedirs(use_tensorboard, exist_ok=True)
            self._tb = SummaryWriter(log_dir=use_tensorboard)
            self._tb.add_text("config", "\n".join(f"{k}: {v}" for k, v in sorted(config.items())))

    @property
    def active(self) -> bool:
        return self._wandb is not None or self._tb is not None

    @property
    def wandb_run_dir(self) -> str | None:
        return None if self._wandb is None else self._wandb.dir

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self._wandb is not None:
            self._wandb.log(dict(metrics), step=step)
        if self._tb is not None and metrics:
            # One event holds every scalar of the step (TensorBoard reads events with several
            # values, as TF's merged summaries wrote them): each event wakes the writer's thread,
            # and 45 wake-ups a step cost rank 0 ~2.5 ms while its peers wait at the next collective.
            values = [value for name, v in metrics.items() for value in self._tb_scalar(name, float(v)).value]
            self._tb._get_file_writer().add_summary(self._tb_summary(value=values), step)

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence], step: int) -> None:
        """Logs a small table: a `wandb.Table` in W&B, and in TensorBoard a text summary holding a
        markdown table (TensorBoard's Text tab renders it)."""
        if self._wandb is not None:
            import wandb

            self._wandb.log({name: wandb.Table(columns=list(columns), data=[list(r) for r in rows])}, step=step)
        if self._tb is not None:
            self._tb.add_text(name, markdown_table(columns, rows), step)

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
