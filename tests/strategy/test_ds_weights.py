"""Reading a checkpoint's weights without an engine (bench): files that would run code are refused
before DeepSpeed opens them, and a file whose bytes changed after the save is refused by name."""

from pathlib import Path

import pytest
import torch

from lightrft.strategy.checkpoint_io import save_checkpoint_dir
from lightrft.strategy.ds_weights import CheckpointReadError, module_state_dict
from tests.strategy.test_checkpoint_io import CreatesFile, overwrite_middle


def checkpoint(save_dir: Path, files: dict) -> Path:
    """A complete checkpoint whose `deepspeed/` folder holds `files` (name -> object to torch.save)."""
    def write_shard(folder: Path) -> None:
        (folder / "deepspeed").mkdir()
        for name, obj in files.items():
            torch.save(obj, folder / "deepspeed" / name)

    return save_checkpoint_dir(save_dir, "global_step1", write_shard)


@pytest.mark.parametrize("name", ["zero_pp_rank_0_mp_rank_00_model_states.pt",    # ZeRO-3: DeepSpeed reads it
                                  "mp_rank_00_model_states.pt"])                   # ZeRO-0/1/2
def test_weights_that_would_run_code_are_refused_unread(tmp_path, name):
    marker = tmp_path / "ran"
    folder = checkpoint(tmp_path / "_actor", {name: {"module": {"w": torch.ones(2)}, "extra": CreatesFile(marker)}})
    with pytest.raises(CheckpointReadError, match=f"{folder / 'deepspeed' / name}: refused to load.*could run code"):
        module_state_dict(folder)
    assert not marker.exists()


def test_model_states_changed_after_the_save_are_refused_naming_the_file(tmp_path):
    folder = checkpoint(tmp_path / "_actor", {"mp_rank_00_model_states.pt": {"module": {"w": torch.ones(4096)}}})
    assert module_state_dict(folder)["w"].sum().item() == 4096
    states = folder / "deepspeed" / "mp_rank_00_model_states.pt"
    overwrite_middle(states)                      # 1024 weights become 3.4e38, the size is kept
    with pytest.raises(CheckpointReadError, match=f"{folder} is corrupted: {states} has crc32"):
        module_state_dict(folder)
