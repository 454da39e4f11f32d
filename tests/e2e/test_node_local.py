"""Two nodes on loopback (2 x 1 rank, `torchrun --nnodes 2`), each with its own checkpoint folder, as
on node-local disks: a checkpoint holds every rank's files in one folder, so the run stops at
start, on both nodes, naming the folder, the ranks whose files each node cannot see and the fix
(a shared filesystem), before any step; never a hang or a checkpoint no node could resume. With
one folder both nodes see, the same job trains, saves and resumes."""

import json
import subprocess
import sys

import pytest

from lightrft.strategy import checkpoint_io
from lightrft.utils.tiny import save_tiny_model
from tests.conftest import REPO_ROOT, free_port, subprocess_env

pytestmark = pytest.mark.dist


def two_nodes(tmp_path, ckpt_paths: list, **extra) -> list[subprocess.CompletedProcess]:
    """train_sft as a two-node job on 127.0.0.1, node k writing checkpoints to ckpt_paths[k]."""
    model = tmp_path / "model"
    if not model.exists():
        save_tiny_model(model)
        rows = [{"input": f"{a}+{b}=", "output": str(a + b)} for a in range(8) for b in range(8)]
        (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    port = free_port()
    procs = []
    for node, ckpt in enumerate(ckpt_paths):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
               "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
               "-m", "lightrft.cli.train_sft", "--pretrain", str(model), "--dataset", str(tmp_path / "train.jsonl"),
               "--input_key", "input", "--output_key", "output", "--max_len", "16", "--train_batch_size", "8",
               "--micro_train_batch_size", "4", "--learning_rate", "1e-3", "--save_steps", "1",
               "--save_path", str(tmp_path / f"out{node}"), "--ckpt_path", str(ckpt)]
        for key, value in extra.items():
            cmd += [f"--{key}"] if value is True else [f"--{key}", str(value)]
        procs.append(subprocess.Popen(cmd, cwd=REPO_ROOT, env=subprocess_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    done = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise AssertionError("the two-node job hung")
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


def test_node_local_checkpoint_folders_stop_the_run_at_start_naming_the_fix(tmp_path):
    nodes = two_nodes(tmp_path, [tmp_path / "node0" / "ckpt", tmp_path / "node1" / "ckpt"], max_steps=2)
    for node, proc in enumerate(nodes):
        assert proc.returncode == 1, proc.stderr[-2000:]
        message = proc.stderr
        assert f"--ckpt_path {tmp_path / f'node{node}' / 'ckpt'} is not one folder for every rank" in message
        assert "rank 0 on " in message and "does not see the files of rank(s) 1" in message
        assert "rank 1 on " in message and "does not see the files of rank(s) 0" in message
        assert "put --ckpt_path on a filesystem every node mounts at the same path" in message
        assert "PPO steps" not in proc.stdout and "global_step" not in proc.stdout
        folder = tmp_path / f"node{node}" / "ckpt"
        assert not any(p.name.startswith("global_step") for p in folder.iterdir())        # nothing saved
        assert not any(p.name.startswith(checkpoint_io.PROBE_PREFIX) for p in folder.iterdir())   # probes removed


def test_one_shared_folder_trains_saves_and_resumes(tmp_path):
    shared = tmp_path / "shared" / "ckpt"
    first = two_nodes(tmp_path, [shared, shared], max_steps=1)
    assert [p.returncode for p in first] == [0, 0], first[1].stderr[-2000:]
    assert (shared / "latest").read_text().strip() == "global_step1"
    resumed = two_nodes(tmp_path, [shared, shared], max_steps=2, load_checkpoint=True)
    assert [p.returncode for p in resumed] == [0, 0], resumed[0].stderr[-2000:]
    assert (shared / "latest").read_text().strip() == "global_step2"


def test_missing_probes_name_the_ranks_a_folder_lacks(tmp_path):
    checkpoint_io.write_probe(tmp_path, "abc", 0)
    checkpoint_io.write_probe(tmp_path, "abc", 2)
    checkpoint_io.write_probe(tmp_path, "other", 1)
    assert checkpoint_io.missing_probes(tmp_path, "abc", 4) == [1, 3]


def test_a_save_whose_folder_lacks_a_rank_s_files_is_not_committed(tmp_path):
    """The save itself checks too: rank 0 commits only a folder holding every rank's client state."""
    def rank0_only(tmp):
        checkpoint_io.save_client_state(tmp, 0, {"step": 1})

    checkpoint_io.save_checkpoint_dir(tmp_path, "global_step1", rank0_only)          # one rank: fine
    with pytest.raises(checkpoint_io.CheckpointSaveError, match=r"the files of rank\(s\) 1 are not in .* as rank 0 "
                                                                r"sees it: the ranks do not share this folder"):
        checkpoint_io.save_checkpoint_dir(tmp_path, "global_step2", rank0_only, ranks=2)
    assert (tmp_path / "latest").read_text().strip() == "global_step1"
    assert not (tmp_path / "global_step2").exists() and not (tmp_path / ".tmp-global_step2").exists()
