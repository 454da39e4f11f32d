"""docs/combinations.md says which pairs of features run together: every row's flags are parsed
as a run would parse them, and lightrft accepts the pairs the table says run and refuses the
others, naming the flags and a reason (not a promise of later work)."""

import re
import shlex
from pathlib import Path

import pytest

from lightrft.config import ConfigError, PPORunConfig

PAGE = Path(__file__).resolve().parents[2] / "docs" / "combinations.md"
BASE = ["--pretrain", "m", "--prompt_data", "p.jsonl", "--remote_rm_url", "math", "--advantage_estimator",
        "group_norm", "--n_samples_per_prompt", "4", "--rollout_batch_size", "8", "--train_batch_size", "32"]


def rows() -> list[tuple[str, list[str], bool]]:
    """(pair, flags, runs) of every table row of the page."""
    found = []
    for line in PAGE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[2] in ("yes", "no"):
            found.append((cells[0], shlex.split(cells[1].strip("`")), cells[2] == "yes"))
    return found


def parse(flags: list[str]) -> PPORunConfig:
    base = list(BASE)
    if "--recorded_data" in flags:      # recorded experiences replace the prompts
        at = base.index("--prompt_data")
        del base[at:at + 2]
    parser = PPORunConfig.build_parser("train_ppo")
    return PPORunConfig.from_namespace(parser.parse_args(base + flags))


# The 17 pairs lightrft refused before explorers, images and sequence parallelism were assembled
# once (by the flags that make them): each has its row, running or refused with its reason.
ONCE_REFUSED = [*({"--explorer_ranks", flag} for flag in ("--vllm_tensor_parallel_size", "--lora_rank",
                                                          "--reward_pretrain", "--dynamic_sampling", "--recorded_data")),
                *({"--image_key", flag} for flag in ("--critic_pretrain", "--reward_pretrain", "--teacher_pretrain",
                                                     "--enable_ema", "--pretrain_data", "--explorer_ranks",
                                                     "--sync_offset", "--recorded_data")),
                *({"--sequence_parallel_size", flag} for flag in ("--image_key", "--aux_loss_coef", "--explorer_ranks",
                                                                  "--sync_offset"))]


def test_the_page_has_a_row_for_every_pair_once_refused():
    assert len(ONCE_REFUSED) == 17
    table = [set(flags) for _, flags, _ in rows()]
    missing = [sorted(pair) for pair in ONCE_REFUSED if not any(pair <= flags for flags in table)]
    assert not missing, missing


@pytest.mark.parametrize("pair, flags, runs", rows(), ids=[row[0] for row in rows()])
def test_each_pair_is_accepted_or_refused_as_the_table_says(pair, flags, runs):
    if runs:
        parse(flags)
        return
    with pytest.raises(ConfigError) as refused:
        parse(flags)
    message = str(refused.value)
    named = [flag for flag in flags if flag.startswith("--")]
    assert any(flag in message for flag in named), message
    assert not re.search(r"\byet\b", message), message
