from setuptools import find_packages, setup

TRANSFORMERS = "transformers>=4.48,<5.25"

setup(
    name="tp-layers",
    version="0.1.0",
    description="Megatron-style tensor-parallel layers for PyTorch: mesh, mappings, parallel linears, Triton kernels",
    packages=find_packages(include=["tp", "tp.*", "kernels", "kernels.*", "models", "models.*", "bench", "bench.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "triton>=3.0; platform_system == 'Linux'",
        "einops>=0.7",
        "numpy",  # Triton's interpreter and torch's DTensor debug tools (CommDebugMode) import it
        "safetensors>=0.4",  # checkpoints and Hugging Face weights
        "tqdm",
        "tomli>=1.1; python_version < '3.11'",  # --config job.toml (tomllib from Python 3.11)
    ],
    extras_require={
        # transformers 5.25 requires Hugging Face's `kernels` distribution, whose import name is our kernels package's
        "hf": [TRANSFORMERS],  # optional: GPT.from_hf / save_hf, tp.parallelize on HF models
        "bench": ["matplotlib"],  # (also the JSONL log's plot at the end of a run)
        "data": ["pyarrow>=14"],  # optional: parquet files and save_to_disk directories as --data
        "tensorboard": ["tensorboard"],  # optional: --tensorboard-dir
        "wandb": ["wandb"],  # optional: --wandb-project
        "test": ["pytest>=7", "pytest-timeout", TRANSFORMERS, "matplotlib", "ruff>=0.6", "pyarrow>=14",
                 "tensorboard"],
    },
)
