"""Model families: how lightrft loads one kind of model and builds the inputs of its forward.

Everything that differs between kinds of models, and that the rest of lightrft must not branch
on, is a method of a `ModelFamily`: which transformers class loads a checkpoint (`load`), what
makes a model untrainable (`check`) or unpackable (`packing_problem`), how long a sequence may be
(`context_length`) and the position ids its forward takes (`position_ids`, from lightrft's own
count of real tokens). The actor, critic,
reward model, their shared-prompt forwards and the Hugging Face rollout engine take their forward
inputs from the family (`padded_inputs`, `packed_inputs`, `shared_inputs`; the engine
`decoding_positions`, `media_inputs` and `banned_token_ids`), so a family changes them everywhere
at once.

A family serves the `model_type`s of the configs it names; `register_family(family)` adds one (a
family shipped with lightrft is a module of this package, imported below), and
`family_for(config)` answers for a config, `CAUSAL_LM` (every decoder-only causal LM whose
positions count tokens from 0) for any type no family names. Adding a family is described in
docs/extending.md ("Adding a model family").
"""

from lightrft.models.families.base import (CAUSAL_LM, MODEL_FAMILIES, ModelFamily, family_for, family_of, load_model,
                                           merge_media, register_family)
# The families shipped with lightrft: importing a module registers it.
from lightrft.models.families import idefics3, qwen_vl, roberta  # noqa: E402,F401  (register their model types)

__all__ = ["CAUSAL_LM", "MODEL_FAMILIES", "ModelFamily", "family_for", "family_of", "load_model", "merge_media",
           "register_family"]
