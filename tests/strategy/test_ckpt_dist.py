"""DeepSpeed checkpoints through DeepspeedStrategy on two gloo ranks: resuming in a new process gives
bit-identical losses (ZeRO-2 and ZeRO-3), and processes killed at protocol stages leave the
previous checkpoint loadable (phases in tests/strategy/dist_ckpt.py). Each phase is one torchrun
launch."""

from pathlib import Path

import pytest

from lightrft.strategy import checkpoint_io as cio
from tests.conftest import read_json_lines, run_torchrun

HERE = Path(__file__).parent
PHASES = ("save", "load", "after")
# The phases that end with a save killed at a stage (os._exit(137) on every rank reaching it).
KILLED_AT = {"save": "mid-shard", "load": "before-pointer"}

pytestmark = pytest.mark.dist


def snapshot(save_dir: Path) -> dict:
    return {"entries": sorted(p.name for p in save_dir.iterdir()),
            "complete": [p.name for _, p in cio.list_complete(save_dir)],
            "latest": cio.read_pointer(save_dir)}


@pytest.fixture(scope="module")
def phases(tmp_path_factory):
    root = tmp_path_factory.mktemp("strategy_ckpt")
    results = {}
    for phase in PHASES:
        proc = run_torchrun([HERE / "dist_ckpt.py", "--phase", phase, "--root", root], nproc=2,
                            check=phase not in KILLED_AT)
        results[phase] = {
            "output": proc.stdout + proc.stderr,
            "returncode": proc.returncode,
            "records": [read_json_lines(root / f"{phase}.rank{r}.jsonl") for r in range(2)],
            "zero2": snapshot(root / "zero2"),
            "zero3": snapshot(root / "zero3"),
        }
    return results


@pytest.mark.parametrize("phase", sorted(KILLED_AT))
def test_killed_phases_died_at_their_stage(phases, phase):
    assert phases[phase]["returncode"] != 0
    assert f"{cio.FAULT_ENV}: exiting at stage {KILLED_AT[phase]}" in phases[phase]["output"]


@pytest.mark.parametrize("stage", [2, 3])
def test_resume_in_new_process_is_bit_identical(phases, stage):
    for rank in range(2):
        saved = [r for r in phases["save"]["records"][rank] if r.get("stage") == stage][0]
        loaded = [r for r in phases["load"]["records"][rank] if r.get("stage") == stage][0]
        assert loaded["path"] == "step2" and loaded["client_step"] == 2
        assert loaded["client_rank"] == rank  # each rank gets back its own client state
        # losses of steps 3 and 4 (weights, Adam moments, LR schedule and data RNG all restored)
        assert loaded["after"] == saved["after"]
        assert loaded["lr"] == saved["lr"] == pytest.approx(5e-3 / 5)
    # the two ranks drew different data
    assert phases["save"]["records"][0][0]["before"] != phases["save"]["records"][1][0]["before"]


def test_kill_mid_shard_leaves_previous_and_ignores_partial(phases):
    after_save = phases["save"]["zero2"]
    assert after_save["complete"] == ["step2"] and after_save["latest"] == "step2"
    assert ".tmp-step4" in after_save["entries"] and "step4" not in after_save["entries"]
    assert [r for r in phases["load"]["records"][0] if r.get("stage") == 2][0]["path"] == "step2"


def test_load_edge_cases_and_injected_error(phases):
    for rank in range(2):
        checks = phases["load"]["records"][rank][-1]
        assert checks["empty"] == [None, None]  # nothing to resume from
        assert "zero3/step4 is missing or incomplete" in checks["missing_tag_error"]
        assert "['step2']" in checks["missing_tag_error"]
        # an OSError on rank 0 before the rename reaches both ranks, naming the checkpoint
        assert "zero3/step4" in checks["injected_error"]
        assert ("injected failure at stage before-rename" if rank == 0 else "failed on another rank") in \
            checks["injected_error"]
    assert phases["load"]["zero3"]["complete"] == ["step2"] and phases["load"]["zero3"]["latest"] == "step2"


def test_kill_before_pointer_keeps_pointer_authoritative(phases):
    after_load = phases["load"]["zero2"]
    assert after_load["complete"] == ["step2", "step4"] and after_load["latest"] == "step2"
    after = phases["after"]["records"][0][0]
    assert after["path"] == "step2" and after["client_step"] == 2
    # resumed from step2 again, so its first step repeats the saved run's step 3
    saved = [r for r in phases["save"]["records"][0] if r.get("stage") == 2][0]
    assert after["losses"] == saved["after"][:1]


def test_clean_save_prunes_to_max_num(phases):
    # max_num=2: step2, the oldest of step2/step4/step5, is removed
    assert phases["after"]["zero2"] == {"entries": ["latest", "step4", "step5"], "complete": ["step4", "step5"],
                                        "latest": "step5"}
