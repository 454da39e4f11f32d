"""docs/combinations.md says which pairs of features run together: every row's flags, and every
cell of the grid's, are parsed as a run would parse them, and lightrft accepts the pairs the page
says run and refuses the others, naming the flags and a reason (not a promise of later work); the
grid's tests exist, and its pairs that are accepted but do not run have their reason under it."""

import re
import shlex
from pathlib import Path

import pytest

from lightrft.config import ConfigError, PPORunConfig

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "combinations.md"
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


def cells_of(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []


def grid_section() -> str:
    """The page's "## The grid" section, up to the next section."""
    text = PAGE.read_text()
    start = text.index("\n## The grid\n")
    return text[start:text.index("\n## ", start + 1)]


def features() -> dict[str, list[str]]:
    """{feature: its flags} of the grid's feature table."""
    found = {}
    for line in grid_section().splitlines():
        cells = cells_of(line)
        if len(cells) == 2 and cells[1].startswith("`"):
            found[cells[0]] = shlex.split(re.match(r"`([^`]+)`", cells[1]).group(1))
    return found


def grid() -> list[tuple[str, str, str]]:
    """(row feature, column feature, cell) of every filled cell of the grid."""
    columns, found = [], []
    for line in grid_section().splitlines():
        cells = cells_of(line)
        if len(cells) > 2 and cells[0] == "":
            columns = cells[1:]
        elif len(cells) > 2 and cells[0].startswith("**"):
            found += [(cells[0].strip("*"), column, cell) for column, cell in zip(columns, cells[1:]) if cell]
    return found


UNTESTED = "yes (untested together)"


def test_the_grid_has_every_pair_of_its_features_once():
    names = list(features())
    assert len(names) == 11, names
    pairs = [frozenset((row, column)) for row, column, _ in grid()]
    assert all(len(pair) == 2 and pair <= set(names) for pair in pairs), pairs
    assert len(set(pairs)) == len(pairs) == 55


@pytest.mark.parametrize("row, column, cell", grid(), ids=[f"{r} x {c}" for r, c, _ in grid()])
def test_each_grid_cell_is_accepted_or_refused_as_it_says(row, column, cell):
    flags = features()[row] + features()[column]
    if cell == "no":            # refused when parsed, the reason in the section rows
        with pytest.raises(ConfigError) as refused:
            parse(flags)
        assert any(flag in str(refused.value) for flag in flags if flag.startswith("--")), str(refused.value)
        return
    parse(flags)                # every other cell's flags are accepted
    if cell.startswith("yes: "):
        for test in cell.removeprefix("yes: ").split(", "):
            assert (ROOT / "tests" / test).is_file(), test
    elif cell.startswith("no ("):   # accepted but not run: the reason is under the grid
        assert f"- **{row} × {column}**, `{cell}`: " in grid_section(), cell
    else:
        assert cell == UNTESTED, cell


def test_no_vision_language_family_lightrft_trains_is_a_mixture_of_experts(tmp_path):
    """The images x MoE aux cell: every vision-language family is dense (no router logits to
    balance), and a mixture-of-experts vision-language folder is refused with --image_key before
    any weight loads (its config alone is read)."""
    from transformers import AutoConfig

    from lightrft.builders.datasets import build_image_prompts
    from lightrft.models.families import MODEL_FAMILIES, ModelFamily

    assert dict(((r, c), cell) for r, c, cell in grid())[("images", "MoE aux")] == "no (at start)"
    vision = [name for name, family in MODEL_FAMILIES.items()
              if type(family).image_media is not ModelFamily.image_media]
    assert vision
    for model_type in vision:
        config = AutoConfig.for_model(model_type)
        assert not hasattr(config, "output_router_logits"), model_type
        assert not hasattr(config.get_text_config(), "output_router_logits"), model_type
    AutoConfig.for_model("qwen3_vl_moe").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="--image_key is set but --pretrain .* is a 'qwen3_vl_moe' model"):
        build_image_prompts(str(tmp_path), tokenizer=None)
