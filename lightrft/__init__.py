"""lightrft: reinforcement fine-tuning of language models (PPO, GRPO, REINFORCE++, RLOO) on DeepSpeed.

`import lightrft` stays light: it imports neither deepspeed, vllm nor transformers. Import the
subpackages you need (`lightrft.models`, `lightrft.trainer`, `lightrft.strategy`, ...).
"""

__version__ = "0.1.0"
