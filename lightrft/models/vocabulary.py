"""One rule, for every entry point, for a model whose embedding has fewer rows than its tokenizer
has tokens (a tokenizer with special tokens added after the model was saved, without
`resize_token_embeddings`).

Such a model works as long as no id past its rows is ever looked up: it cannot produce one (its
LM head has as many rows), so only the ids fed to it matter. `check_vocabulary` accepts the model
with one warning when none of the ids a run is known to feed is out of range (the pad, EOS, BOS and
unknown tokens, the special tokens its chat template writes, the ids of its data), and refuses it
with the fix when one is. Where ids arrive later (a server's requests), `vocabulary_rows` gives the
bound to check them against.
"""

import logging
from collections.abc import Iterable, Mapping
from functools import cache

from torch import nn

logger = logging.getLogger("lightrft")

# A short conversation rendered with a tokenizer's chat template shows the special tokens it writes.
TEMPLATE_PROBE = ({"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                  {"role": "assistant", "content": "a"})


def hf_model(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside a lightrft wrapper (`ActorLanguage`, `Critic`, `RewardModel`)."""
    while not hasattr(model, "get_input_embeddings") and isinstance(getattr(model, "model", None), nn.Module):
        model = model.model
    return model


def vocabulary_rows(model: nn.Module) -> int:
    """How many token ids `model` can take: the rows of its input embedding, and of its LM head
    when it has one (the ids it can produce). Read from the module shapes, so a ZeRO-3
    partitioned model gives its full size."""
    model = hf_model(model)
    rows = model.get_input_embeddings().num_embeddings
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, nn.Linear):
        rows = min(rows, head.out_features)
    return rows


def tokens_always_fed(tokenizer, *, chat_template: bool) -> dict[int, str]:
    """{id: what it is} of the tokens a run feeds a model whatever its data: the pad, EOS, BOS and
    unknown tokens, and with `chat_template` the tokens the tokenizer's chat template writes."""
    fed = {}
    for name in ("pad_token", "eos_token", "bos_token", "unk_token"):
        token_id = getattr(tokenizer, f"{name}_id", None)
        if token_id is not None:
            fed.setdefault(int(token_id), f"the {name.replace('_', ' ')} {getattr(tokenizer, name)!r}")
    if chat_template and getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template(list(TEMPLATE_PROBE), tokenize=False)
        except Exception:  # templates that refuse a system turn
            text = tokenizer.apply_chat_template(list(TEMPLATE_PROBE[1:]), tokenize=False)
        for token_id in tokenizer(text, add_special_tokens=False)["input_ids"]:
            fed.setdefault(int(token_id), f"the chat template's token {tokenizer.convert_ids_to_tokens(token_id)!r}")
    return fed


def ids_in_data(rows: Iterable[Iterable[int]], source: str) -> dict[int, str]:
    """{id: where it first occurs} over token-id rows of a data set named `source` (a flag and file)."""
    found = {}
    for index, ids in enumerate(rows):
        for token_id in ids:
            found.setdefault(int(token_id), f"a token of row {index} of {source}")
    return found


@cache
def _warn_once(message: str) -> None:
    logger.warning(message)


def check_vocabulary(model: nn.Module, tokenizer, what: str, *, chat_template: bool = False,
                     fed: Mapping[int, str] | None = None, produced_by: int | None = None) -> int:
    """Checks that every id fed to `model` (named `what` in messages: a flag and path) is a row of
    its embedding; returns its rows (`vocabulary_rows`).

    The ids checked are `tokens_always_fed(tokenizer, chat_template=...)`, the ids of `fed` ({id:
    what it is}, e.g. `ids_in_data`) and, for a model that scores another model's samples, every id
    below `produced_by` (the rows of the policy that samples them). With a tokenizer longer than the
    embedding and none of these out of range, it warns once and accepts; otherwise it raises a
    ValueError that names the ids and the fix.
    """
    rows = vocabulary_rows(model)
    size = len(tokenizer)
    if produced_by is not None and produced_by > rows:
        raise ValueError(f"{what}: the model's embedding has {rows} rows, but the policy can sample token ids up to "
                         f"{produced_by - 1}, which it would be given to score; use a model with the policy's "
                         f"vocabulary, or resize its embeddings (model.resize_token_embeddings({produced_by}), then "
                         "save it)")
    if size <= rows:
        return rows
    candidates = {**tokens_always_fed(tokenizer, chat_template=chat_template), **(fed or {})}
    outside = {token_id: why for token_id, why in candidates.items() if token_id >= rows}
    if outside:
        named = ", ".join(f"{why} (id {token_id})" for token_id, why in sorted(outside.items())[:5])
        raise ValueError(f"{what}: the tokenizer has {size} tokens but the model's embedding only {rows} rows, and "
                         f"{named} would be looked up past its end. Resize the model's embeddings to the tokenizer "
                         f"(model.resize_token_embeddings(len(tokenizer)), then save_pretrained) or use the tokenizer "
                         f"the model was trained with")
    unused = tokenizer.convert_ids_to_tokens(list(range(rows, min(size, rows + 5))))
    _warn_once(f"{what}: the tokenizer has {size} tokens but the model's embedding only {rows} rows; ids {rows}.."
               f"{size - 1} ({', '.join(map(repr, unused))}{', ...' if size - rows > 5 else ''}) are not fed by this "
               f"run and the model cannot produce them, so it goes on. model.resize_token_embeddings(len(tokenizer)) "
               "makes the two agree")
    return rows
