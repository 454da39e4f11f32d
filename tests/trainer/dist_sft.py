"""SFTTrainer and RewardModelTrainer steps on two ranks (ZeRO-2, gloo) against whole-batch references.

Run by tests/trainer/test_sft_trainer.py with `torchrun --nproc_per_node 2`. The optimizer is plain
SGD with lr 1 and clipping off, so a step moves every weight by exactly minus the gradient and the
update can be compared with the gradient of the whole global batch computed in one process.
Writes one JSON line (rank 0) to `--out`.
"""

import argparse
import copy
import json
from types import SimpleNamespace

import torch

from lightrft.datasets import PreferenceDataset, SFTDataset
from lightrft.models import ActorLanguage, RewardModel
from lightrft.models.hf_utils import value_model_class
from lightrft.strategy import DeepspeedStrategy, StrategyConfig
from lightrft.trainer.rm_trainer import RewardModelTrainer
from lightrft.trainer.sft_trainer import SFTTrainer
from lightrft.utils.tiny import build_char_tokenizer, build_tiny_causal_lm
from lightrft.utils.program import run_program

MICRO, GLOBAL = 2, 8  # per rank per forward; per optimizer step over 2 ranks -> 2 accumulation steps


def sft_rows(n: int) -> list[dict]:
    # Responses of different lengths, so micro-batches hold different numbers of response tokens and
    # a per-micro-batch mean would weight tokens unequally.
    return [{"input": f"Q{i}:", "output": "ab" * (1 + i % 4) + str(i)} for i in range(n)]


def preference_rows(n: int) -> list[dict]:
    return [{"chosen": f"ok{'!' * (1 + i % 3)} {i}", "rejected": f"no {i}" + "." * (i % 2), "m": 0.1 * i}
            for i in range(n)]


def whole_batch_sft(model, samples, dataset) -> torch.Tensor:
    """Token-mean response NLL of `samples` in one padded batch. Shape: scalar."""
    batch = dataset.collate_fn(samples)
    log_probs = model(batch.input_ids, batch.num_actions, attention_mask=batch.attention_mask)
    return -(log_probs * batch.loss_mask).sum() / batch.loss_mask.sum()


def sgd_engine(strategy, module):
    optim = torch.optim.SGD(module.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: 1.0)
    return strategy.prepare((module, optim, scheduler))


def max_step_error(strategy, engine, reference_module, initial_params) -> tuple[float, float]:
    """max |w_after - (w_before - g_ref)| and max |g_ref| over all parameters (ZeRO-2 keeps whole
    parameters on every rank)."""
    after = dict(strategy.unwrap_model(engine).named_parameters())
    error = scale = 0.0
    for name, param in reference_module.named_parameters():
        expected = initial_params[name] - param.grad
        error = max(error, (after[name].detach().cpu() - expected).abs().max().item())
        scale = max(scale, param.grad.abs().max().item())
    return error, scale


def check_sft(strategy, tokenizer) -> dict:
    dataset = SFTDataset(sft_rows(8), tokenizer, max_len=32)
    eval_set = SFTDataset(sft_rows(15)[8:], tokenizer, max_len=32)  # 7 samples: fillers on one rank
    module = ActorLanguage(build_tiny_causal_lm(tokenizer, seed=0))
    reference = copy.deepcopy(module)
    initial = {k: v.detach().clone() for k, v in reference.named_parameters()}
    # Reference: the global batch of 8 samples in one process.
    ref_loss = whole_batch_sft(reference, list(dataset), dataset)
    ref_loss.backward()

    engine, optim, scheduler = sgd_engine(strategy, module)
    trainer = SFTTrainer(strategy, engine, optim, scheduler, tokenizer, eval_dataset=eval_set,
                         eval_collate_fn=dataset.collate_fn)
    trainer.args = SimpleNamespace(micro_train_batch_size=MICRO)
    # This rank's share of the step (rank r: samples r, r+2, r+4, r+6), packed into micro-batches.
    mine = [dataset[i] for i in range(strategy.rank, GLOBAL, 2)]
    micro_batches = [dataset.packing_collate_fn(mine[:MICRO]), dataset.packing_collate_fn(mine[MICRO:])]
    logs = trainer.training_step(micro_batches)
    error, scale = max_step_error(strategy, engine, reference, initial)

    with torch.no_grad():
        for name, param in reference.named_parameters():
            param -= param.grad
        ref_eval = whole_batch_sft(reference, list(eval_set), eval_set).item()
    return {"loss": logs["train/loss"], "ref_loss": ref_loss.item(), "tokens": logs["train/tokens"],
            "ref_tokens": sum(int((s.labels != -100).sum()) for s in dataset), "step_error": error,
            "grad_scale": scale, "eval": trainer.evaluate(), "ref_eval": ref_eval}


def check_rm(strategy, tokenizer) -> dict:
    dataset = PreferenceDataset(preference_rows(8), tokenizer, margin_key="m", max_len=32)
    eval_set = PreferenceDataset(preference_rows(13)[8:], tokenizer, margin_key="m", max_len=32)
    torch.manual_seed(0)
    backbone = build_tiny_causal_lm(tokenizer, seed=0)
    value_model = value_model_class(type(backbone.model), "score")(backbone.config)
    value_model.model.load_state_dict(backbone.model.state_dict())
    module = RewardModel(value_model)
    reference = copy.deepcopy(module)
    initial = {k: v.detach().clone() for k, v in reference.named_parameters()}
    batch = dataset.collate_fn(list(dataset))
    chosen = reference(batch.chosen_ids, attention_mask=batch.chosen_mask)
    rejected = reference(batch.rejected_ids, attention_mask=batch.rejected_mask)
    ref_loss = -torch.nn.functional.logsigmoid(chosen - rejected - batch.margins).mean()
    ref_loss.backward()

    engine, optim, scheduler = sgd_engine(strategy, module)
    trainer = RewardModelTrainer(strategy, engine, optim, scheduler, tokenizer, eval_dataset=eval_set,
                                 eval_collate_fn=dataset.collate_fn)
    trainer.args = SimpleNamespace(micro_train_batch_size=MICRO)
    mine = [dataset[i] for i in range(strategy.rank, GLOBAL, 2)]
    logs = trainer.training_step([dataset.collate_fn(mine[:MICRO]), dataset.collate_fn(mine[MICRO:])])
    error, scale = max_step_error(strategy, engine, reference, initial)

    with torch.no_grad():
        for name, param in reference.named_parameters():
            param -= param.grad
        eval_batch = eval_set.collate_fn(list(eval_set))
        c = reference(eval_batch.chosen_ids, attention_mask=eval_batch.chosen_mask)
        r = reference(eval_batch.rejected_ids, attention_mask=eval_batch.rejected_mask)
        ref_eval = {"eval/loss": (-torch.nn.functional.logsigmoid(c - r - eval_batch.margins)).mean().item(),
                    "eval/acc": (c > r).float().mean().item()}
        train_scores = torch.cat([reference(batch.chosen_ids, attention_mask=batch.chosen_mask),
                                  reference(batch.rejected_ids, attention_mask=batch.rejected_mask)])
    mean, std = trainer.reward_statistics(dataset, dataset.collate_fn)
    return {"loss": logs["train/loss"], "ref_loss": ref_loss.item(), "acc": logs["train/acc"],
            "ref_acc": (chosen > rejected).float().mean().item(), "step_error": error, "grad_scale": scale,
            "eval": trainer.evaluate(), "ref_eval": ref_eval, "stats": [mean, std],
            "ref_stats": [train_scores.mean().item(), train_scores.std(unbiased=False).item()]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    # max_norm huge: no clipping, so the SGD step is exactly minus the gradient.
    strategy = DeepspeedStrategy(StrategyConfig(seed=0, zero_stage=2, micro_train_batch_size=MICRO,
                                                train_batch_size=GLOBAL, max_norm=1e9))
    strategy.setup_distributed()
    tokenizer = build_char_tokenizer()
    result = {"gas": strategy.accumulated_gradient, "sft": check_sft(strategy, tokenizer),
              "rm": check_rm(strategy, tokenizer)}
    if strategy.is_rank_0():
        with open(args.out, "w") as f:
            f.write(json.dumps(result) + "\n")
    strategy.close()


if __name__ == "__main__":
    run_program(main)
