"""Guards every trainer shares: counting optimizer steps skipped for non-finite values, and
turning a failed checkpoint save into a message instead of a crash."""

import math


class NonFiniteGuard:
    """Counts optimizer steps whose loss or gradient norm was not finite (skipped: by DeepSpeed's
    ZeRO and bf16 optimizers, or by `DeepspeedStrategy.optimizer_step` under ZeRO-0 in fp32) and
    says when `max_in_row` of them came in a row."""

    def __init__(self, max_in_row: int = 3):
        self.max_in_row = max_in_row
        self.skipped = 0
        self.in_row = 0
        self.sources: list[str] = []

    def record(self, sources: list[str]) -> None:
        """`sources` names what was not finite in this step (empty for a good step)."""
        if sources:
            self.skipped += 1
            self.in_row += 1
            self.sources += sources
        else:
            self.in_row = 0

    @property
    def exhausted(self) -> bool:
        return self.in_row >= self.max_in_row

    def message(self, ckpt_path: str) -> str:
        return (f"stopping: {self.in_row} optimizer steps in a row were skipped for non-finite values "
                f"({', '.join(sorted(set(self.sources)))}); the last good weights are saved in {ckpt_path}. "
                "Lower the learning rate or check the data and reward source.")


def nonfinite_grad_norms(strategy, **models) -> list[str]:
    """Names of the DeepSpeed engines whose last global gradient norm (`strategy.grad_norm`) was
    not finite."""
    bad = []
    for name, model in models.items():
        norm = strategy.grad_norm(model) if model is not None else None
        if norm is not None and not math.isfinite(norm):
            bad.append(f"{name} gradient norm")
    return bad
