"""Serving the policy being trained: an OpenAI-compatible HTTP server (`openai_api`), the
policy and its weight reloads (`policy`), and the experiences it records for training (`records`).
`lightrft.cli.serve` wires them; `lightrft.experience.recorded` trains on the records."""

from lightrft.serving.records import ExperienceRecord, ExperienceRecorder, read_records, tokenizer_fingerprint

__all__ = ["ExperienceRecord", "ExperienceRecorder", "read_records", "tokenizer_fingerprint"]
