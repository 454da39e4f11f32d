"""Datasets: loading rows from files, validating them, and the prompt / SFT / preference datasets.
`lightrft.datasets.toy` is a toy task with exact answers for the quickstart, tests and benchmarks."""

from lightrft.datasets.loaders import SUPPORTED_FORMATS, load_rows
from lightrft.datasets.preference_dataset import (
    PreferenceBatch,
    PreferenceDataset,
    PreferencePair,
    encode_for_reward,
    pad_preference_batch,
)
from lightrft.datasets.prompt_dataset import PromptDataset
from lightrft.datasets.sft_dataset import IGNORE_INDEX, SFTBatch, SFTDataset, SFTSample, pack_sft_batch, pad_sft_batch
from lightrft.datasets.split import split_train_eval
from lightrft.datasets.validation import DatasetRowError, SkipReport, check_field, process_rows, validate_rows

__all__ = [
    "DatasetRowError", "IGNORE_INDEX", "PreferenceBatch", "PreferenceDataset", "PreferencePair", "PromptDataset",
    "SFTBatch", "SFTDataset", "SFTSample", "SUPPORTED_FORMATS", "SkipReport", "check_field", "encode_for_reward",
    "load_rows", "pack_sft_batch", "pad_preference_batch", "pad_sft_batch", "process_rows", "split_train_eval",
    "validate_rows",
]
