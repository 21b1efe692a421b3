"""fastmae: install with `pip install torch==2.13.0` first (the CPU wheel), then `pip install -e ".[dev]"`."""

from setuptools import setup

setup(
    name="fastmae",
    version="0.1.0",
    description="Fast masked-LM pretraining with [MASK]-free encoders (MAE-LM, 3ML) and the RoBERTa MLM baseline",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # kernels/ installs as fastmae.kernels: a top-level `kernels` would collide with the PyPI package `kernels`.
    packages=["fastmae", "fastmae.config", "fastmae.data", "fastmae.hf", "fastmae.kernels", "fastmae.study"],
    package_dir={"fastmae": "fastmae", "fastmae.kernels": "kernels"},
    install_requires=[
        # Bounded so the local CPU wheel (2.13.0) satisfies it and pip never fetches a CUDA build.
        "torch>=2.6,<2.15",
        # the Triton kernels run on Linux GPUs; everything else (and the CPU path) imports without it
        "triton>=3.2,<4; platform_system == 'Linux'",
        "numpy>=1.24",
        "tqdm>=4.60",
        "zstandard>=0.22",
        "pyyaml>=6.0",
        "sentencepiece>=0.2",
        "safetensors>=0.4",
        "deepspeed>=0.19,<0.20",
        "psutil>=5.9",
        "matplotlib>=3.7",
    ],
    extras_require={
        # pyarrow: the Parquet reader's tests; transformers + protobuf: the export tests (the hf extra). pytest 9.2
        # keeps node ids where pytest-xdist 3.8 cannot tag them, so --dist loadgroup stops grouping: tests sharing
        # an expensive run (xdist_group) would then repeat it on both workers
        "dev": ["pytest>=8,<9.2", "pytest-xdist>=3.5", "ruff>=0.5", "pyarrow>=14", "transformers>=4.40",
                "protobuf>=3.20"],
        # flash-attn builds only with CUDA; NVIDIA apex is never a pip requirement (PyPI's `apex` is another project).
        "gpu": ["flash-attn>=2.5"],
        # `fastmae export` and the Hugging Face benchmark; protobuf reads the sentencepiece model's pieces
        "hf": ["transformers>=4.40", "protobuf>=3.20"],
    },
    entry_points={"console_scripts": ["fastmae=fastmae.cli:main"]},
)
