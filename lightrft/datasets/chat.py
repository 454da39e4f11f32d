"""Chat templates: turning a row's text or messages into the string the model sees.

A string input becomes one user message; a list input is taken as the conversation. Template
failures (a Jinja error, a template that rejects a role order) become row errors naming the field.
"""

from typing import Any

from lightrft.datasets.validation import DatasetRowError, check_messages


def require_chat_template(tokenizer: Any) -> None:
    """Raises a configuration error if `--apply_chat_template` is set but the tokenizer has no template."""
    if getattr(tokenizer, "chat_template", None) is None:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(f"--apply_chat_template is set but the tokenizer {name!r} has no chat template; "
                         "drop the flag, or use a model folder whose tokenizer_config.json has one")


def to_messages(value: Any, key: str, source: str, index: int) -> list[dict]:
    """A string becomes `[{"role": "user", "content": value}]`; a list is checked and returned."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    return [dict(m) for m in check_messages(value, key, source, index)]


def render_chat(tokenizer: Any, messages: list[dict], add_generation_prompt: bool, key: str, source: str,
                index: int) -> str:
    """`tokenizer.apply_chat_template(messages, tokenize=False)`; a failure is a row error on `key`."""
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # Jinja raises TemplateError, but templates also raise KeyError/TypeError
        raise DatasetRowError(source, index, key, f"the chat template failed: {type(e).__name__}: {e}",
                              "check the roles and their order for this model's template",
                              kind="chat template failed") from None
    if not isinstance(text, str):
        raise DatasetRowError(source, index, key, "the chat template did not return a string",
                              kind="chat template failed")
    return text


def assistant_spans(tokenizer: Any, messages: list[dict], first_trained: int, key: str, source: str,
                    index: int) -> tuple[str, list[tuple[int, int]]]:
    """Renders a conversation and finds the character spans of the assistant turns to train on.

    The span of assistant message i is the text between the rendering of messages[:i] with a
    generation prompt and the rendering of messages[:i+1]; only messages at index >= first_trained
    count. Returns (full text, [(start, end) character spans])."""
    full = render_chat(tokenizer, messages, False, key, source, index)
    spans = []
    for i in range(first_trained, len(messages)):
        if messages[i]["role"] != "assistant":
            continue
        before = render_chat(tokenizer, messages[:i], True, key, source, index) if i else ""
        through = render_chat(tokenizer, messages[: i + 1], False, key, source, index)
        if not (through.startswith(before) and full.startswith(through)):
            raise DatasetRowError(source, index, key,
                                  f"the chat template renders the conversation up to message {i} differently "
                                  "from its prefix, so the assistant tokens cannot be located",
                                  "use a template that renders earlier turns unchanged",
                                  kind="chat template failed")
        spans.append((len(before), len(through)))
    return full, spans
