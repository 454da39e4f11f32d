"""The tokenizer builder's names where run code first imported them: the builder itself lives in
`lightrft.models.tokenizer`, below the reward judge and the served policy that load one too."""

from lightrft.models.tokenizer import build_tokenizer, stop_token_ids  # noqa: F401
