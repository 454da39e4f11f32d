"""DeepspeedStrategy on real DeepSpeed with gloo: two ranks against one, ZeRO 0/2/3, EMA,
collectives, data loading and HF export (one torchrun launch plus one plain-python run)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightrft.utils.tiny import save_tiny_model
from safetensors.torch import load_file
from tests.conftest import REPO_ROOT, read_json_lines, run_torchrun, subprocess_env

HERE = Path(__file__).parent
STAGES = (0, 2, 3)

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two ranks (micro batch 2, GAS 1) and one plain process (micro batch 2, GAS 2) train on the
    same global batches of 4 sequences. The two-rank launch also runs ZeRO-2 with optimizer offload,
    EMA, collectives, data loading and the ZeRO-3 export checks."""
    out = tmp_path_factory.mktemp("strategy_train")
    save_tiny_model(out / "source", arch="qwen2", seed=3)
    run_torchrun([HERE / "dist_train.py", "--out", out / "dist.jsonl", "--ema", "--collectives", "--offload",
                  "--hf_source", out / "source"], nproc=2)
    single = subprocess.run([sys.executable, str(HERE / "dist_train.py"), "--out", str(out / "single.jsonl")],
                            cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    if single.returncode:
        pytest.fail(f"single-process run failed:\n{single.stdout[-4000:]}\n{single.stderr[-6000:]}")
    records = {}
    for name, ranks in (("dist", 2), ("single", 1)):
        records[name] = [read_json_lines(out / f"{name}.jsonl.rank{r}") for r in range(ranks)]
    return out, records


def by_check(records, check, **match):
    return [r for r in records if r["check"] == check and all(r[k] == v for k, v in match.items())]


def test_environment_without_launcher_is_world_of_one(runs):
    _, records = runs
    assert by_check(records["single"][0], "env") == [
        {"check": "env", "rank": 0, "world": 1, "local_rank": 0, "backend": "gloo"}]
    assert [by_check(r, "env")[0]["rank"] for r in records["dist"]] == [0, 1]
    assert {by_check(r, "env")[0]["world"] for r in records["dist"]} == {2}


@pytest.mark.parametrize("stage", STAGES)
def test_loss_falls_and_matches_one_rank(runs, stage):
    out, records = runs
    dist_run = by_check(records["dist"][0], "train", name=f"stage{stage}")[0]
    single_run = by_check(records["single"][0], "train", name=f"stage{stage}")[0]
    # GAS = 4 / (2 x 2) on two ranks and 4 / (2 x 1) on one.
    assert (dist_run["gas"], single_run["gas"]) == (1, 2)
    losses = dist_run["losses"]
    assert losses[-1] < losses[0] - 0.3, losses
    assert losses == pytest.approx(single_run["losses"], rel=1e-5, abs=1e-5)
    # Both ranks report the same (all-reduced) losses.
    assert by_check(records["dist"][1], "train", name=f"stage{stage}")[0]["losses"] == losses
    # LambdaLR 1 / (1 + step) after 6 steps: 1e-2 / 7.
    assert dist_run["lr"] == pytest.approx(1e-2 / 7)
    assert dist_run["optimizer"] == "AdamW"
    two = torch.load(out / f"weights_stage{stage}_world2.pt")
    one = torch.load(out / f"weights_stage{stage}_world1.pt")
    assert two.keys() == one.keys()
    for key in two:
        torch.testing.assert_close(two[key], one[key], rtol=1e-4, atol=1e-5, msg=key)


def test_stages_and_optimizer_offload_agree(runs):
    out, records = runs
    offload = by_check(records["dist"][0], "train", name="stage2offload")[0]
    assert offload["optimizer"] == "DeepSpeedCPUAdam"
    assert offload["losses"] == pytest.approx(by_check(records["dist"][0], "train", name="stage0")[0]["losses"],
                                              rel=1e-5, abs=1e-5)
    reference = torch.load(out / "weights_stage0_world2.pt")
    for name in ("stage2", "stage3", "stage2offload"):
        other = torch.load(out / f"weights_{name}_world2.pt")
        for key in reference:
            torch.testing.assert_close(other[key], reference[key], rtol=1e-4, atol=1e-5, msg=key)


def test_hf_folder_from_zero3_loads_and_equals_zero0(runs):
    out, _ = runs
    zero3 = AutoModelForCausalLM.from_pretrained(out / "hf_stage3")
    zero0 = AutoModelForCausalLM.from_pretrained(out / "hf_stage0")
    weights = torch.load(out / "weights_stage3_world2.pt")
    assert (out / "hf_stage3" / "model.safetensors").exists()
    assert not list(out.glob(".hf_stage*"))  # no temporary or parked folders left behind
    for key, tensor in zero3.state_dict().items():
        torch.testing.assert_close(tensor, zero0.state_dict()[key], rtol=1e-4, atol=1e-5, msg=key)
        torch.testing.assert_close(tensor, weights[key], rtol=0, atol=0, msg=key)
    tokenizer = AutoTokenizer.from_pretrained(out / "hf_stage3")
    assert tokenizer.decode(tokenizer("a+b=3")["input_ids"]) == "a+b=3"


@pytest.mark.parametrize("stage", STAGES)
def test_ema_formula_on_known_weights(runs, stage):
    out, records = runs
    # Two optimizer steps move the average; the third call comes without a step and does not.
    assert by_check(records["dist"][0], "ema", stage=stage)[0]["moved"] == [True, True, False]
    init = torch.load(out / f"ema_init_stage{stage}.pt")
    final = torch.load(out / f"ema_final_stage{stage}.pt")
    beta = 0.9
    for key, ema0 in init["ema0"].items():
        param = init["param0"][key]  # lr = 0 keeps the trained weights at their initial values
        once = beta * ema0 + (1 - beta) * param
        twice = beta * once + (1 - beta) * param
        torch.testing.assert_close(final[key], twice, rtol=1e-6, atol=1e-6, msg=key)


def test_all_reduce_and_all_gather(runs):
    _, records = runs
    for rank, recs in enumerate(records["dist"]):
        reduced = by_check(recs, "all_reduce")[0]
        # rank 0 holds [1, 10], rank 1 holds [2, 20].
        assert reduced["mean"] == [1.5, 15.0]
        assert reduced["sum"] == [3.0, 30.0]
        assert reduced["max"] == [2.0, 20.0]
        assert reduced["dict_mean"] == {"a": 0.5, "b": 1.0}
        assert reduced["int_mean"] == [1.5]
        assert reduced["input_unchanged"] == [rank + 1.0, 10.0 * (rank + 1)]
        in_flight = by_check(recs, "in_flight")[0]
        assert in_flight["first"] == [1.5, 15.0] and in_flight["between"] == [2.0, 20.0]
        assert in_flight["many"] == {"a": [3.0, 30.0], "b": [[1.0], [2.0]]}
        assert in_flight["many_again"] == [3.0, 30.0] and in_flight["input_unchanged"] == [rank + 1.0, 10.0 * (rank + 1)]
        gathered = by_check(recs, "all_gather")[0]
        # rank 0 has one row of 0s, rank 1 two rows of 1s.
        assert gathered["tensor"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
        assert gathered["scalar"] == [0.0, 1.0]
        assert gathered["dict"] == {"x": [0.0, 1.5]}
        assert "'median' is not one of mean, sum, max, min" in by_check(recs, "bad_op")[0]["error"]


def test_dataloader_slices_are_disjoint_and_resume(runs):
    _, records = runs
    data = [by_check(recs, "data")[0] for recs in records["dist"]]
    # 11 samples, drop_last: 5 per rank, disjoint.
    epoch0 = data[0]["epoch0"] + data[1]["epoch0"]
    assert len(epoch0) == 10 and len(set(epoch0)) == 10
    assert data[0]["epoch0"] != data[0]["epoch1"]  # the shuffle changes with the epoch
    # 4 consumed samples over 2 ranks: each rank skips its first 2.
    for rank in range(2):
        assert data[rank]["resumed"] == data[rank]["epoch1"][2:]


def test_non_dividing_batch_sizes_name_the_flags(runs):
    _, records = runs
    error = by_check(records["dist"][0], "bad_batch")[0]["error"]
    assert "--train_batch_size 6" in error and "--micro_train_batch_size 2" in error and "world size 2" in error


def test_zero3_init_context_loads_partitioned(runs):
    _, records = runs
    for recs in records["dist"]:
        loaded = by_check(recs, "zero_init")[0]
        assert loaded["all_partitioned"]
        # each of the two ranks holds half of every parameter (rounded up per parameter)
        assert loaded["full_numel"] / 2 <= loaded["local_numel"] < loaded["full_numel"] / 2 + 100


def test_lora_model_is_exported_merged(runs):
    out, _ = runs
    state = torch.load(out / "peft_state.pt")
    exported = AutoModelForCausalLM.from_pretrained(out / "hf_peft").state_dict()
    prefix = "model.base_model.model."
    scale = 8 / 4  # lora_alpha / r
    merged_layers = 0
    for key, tensor in exported.items():
        module, leaf = key.rsplit(".", 1)
        base_key = f"{prefix}{module}.base_layer.{leaf}"  # peft keeps the wrapped layer's own tensors here
        base = state[base_key] if base_key in state else state[prefix + key]
        lora_a = state.get(f"{prefix}{module}.lora_A.default.weight")
        if lora_a is not None and leaf == "weight":
            lora_b = state[f"{prefix}{module}.lora_B.default.weight"]
            assert lora_b.abs().max() > 0  # the adapters trained, so merging changes the weight
            # W' = W + (alpha / r) B A (Hu et al. 2021, LoRA eq. 3)
            torch.testing.assert_close(tensor, base + scale * lora_b @ lora_a, rtol=1e-6, atol=1e-6, msg=key)
            merged_layers += 1
        else:
            assert torch.equal(tensor, base), key
    assert merged_layers == 4  # q_proj and v_proj in each of 2 layers


def test_wrapper_with_own_save_pretrained_gets_gathered_weights(runs):
    out, _ = runs
    state = torch.load(out / "value_state.pt")
    written = load_file(out / "hf_value" / "model.safetensors")
    assert "score.weight" in written and written.keys() == state.keys()
    for key in state:
        assert torch.equal(written[key], state[key]), key
    assert written["score.weight"].shape == (1, 64)


def test_failed_export_raises_on_every_rank_naming_the_target(runs):
    out, records = runs
    for recs in records["dist"]:
        record = by_check(recs, "export_error")[0]
        assert f"saving the Hugging Face model to {out / 'blocker' / 'hf'} failed" in record["error"]
        assert record["memory"]["max_rss_gib"] > 0
    assert (out / "blocker").is_file()


def test_incomplete_launcher_environment_is_refused():
    code = ("from lightrft.strategy import DeepspeedStrategy, StrategyConfig\n"
            "DeepspeedStrategy(StrategyConfig()).setup_distributed()")
    env = subprocess_env(RANK="0", WORLD_SIZE="2")
    for key in ("LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    assert "incomplete launcher environment: LOCAL_RANK, MASTER_ADDR, MASTER_PORT not set" in proc.stderr


@pytest.mark.gpu
def test_bf16_nccl_training_on_gpus(tmp_path):
    """The same script on CUDA with NCCL and bf16, on up to two GPUs."""
    nproc = min(2, torch.cuda.device_count())
    # gpu=True: the launched ranks see the GPUs (the CPU tests hide them, so a one-GPU machine ran gloo).
    run_torchrun([HERE / "dist_train.py", "--out", tmp_path / "gpu.jsonl", "--bf16", "--stages", "0,3"], nproc=nproc,
                 gpu=True)
    records = read_json_lines(tmp_path / "gpu.jsonl.rank0")
    assert by_check(records, "env")[0]["backend"] == "nccl"
    for stage in (0, 3):
        losses = by_check(records, "train", name=f"stage{stage}")[0]["losses"]
        assert losses[-1] < losses[0] - 0.3, losses
