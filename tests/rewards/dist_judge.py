"""Launched by test_judge.py under torchrun (2 ranks, gloo): argv = random judge folder, known judge
folder, inputs JSON, output JSON. Each rank loads both judges on its own and judges the same
inputs (rank 1 in reverse order, 3 at a time instead of 4); rank 0 writes every rank's answers
(in input order) and scores."""

import json
import sys

import torch.distributed as dist

from lightrft.rewards.judge import JudgeSource, LocalJudge
from lightrft.utils.program import run_program


def main(random_folder: str, known_folder: str, inputs_path: str, out_path: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    inputs = json.loads(open(inputs_path).read())
    texts = inputs["texts"] if rank == 0 else inputs["texts"][::-1]
    answers = [a.text for a in LocalJudge.from_pretrained(random_folder, max_new_tokens=8,
                                                          batch_size=4 if rank == 0 else 3).answer(texts)]
    source = JudgeSource(LocalJudge.from_pretrained(known_folder, max_new_tokens=4), "{response}", "number:10",
                         on_failure="drop")
    queries, prompts = inputs["queries"], inputs["prompts"]
    result = source.score(queries, prompts, [None] * len(queries))
    row = {"rank": rank, "answers": answers if rank == 0 else answers[::-1], "scores": result.rewards.tolist(),
           "valid": result.valid.tolist()}
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    run_program(main, *sys.argv[1:5])
