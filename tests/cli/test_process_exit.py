"""`autohet node`, `autohet train` and `autohet rendezvous` end their process without Python's
finalization (cli/main.py's UNFINALIZED): with torch and megatron-core imported it costs about
1.2 CPU-s, 7-15 s at an elastic job's end on a loaded machine, twice in a row (the workers, then
their agent)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("command, finalized", [("node", False), ("show", True)])
def test_a_node_agent_process_ends_without_pythons_finalization(command, finalized, tmp_path):
    """Seen from an atexit handler, which finalization runs: not for `autohet node` (its
    torchrun agent replaced by one that returns at once; its training arguments a complete
    elastic job, which the node checks before its agent starts); for other commands, and main()
    called with arguments (a library call, tests/elastic/test_notices.py), as usual."""
    args = {"node": ["node", "--rendezvous", "127.0.0.1:1", "--job-id", "j", "--nnodes", "1:1",
                     "--node-name", "n", "--gpu", "H800", "--cold-workers", "--", "--plan",
                     str(ROOT / "configs/plans/tiny-two-pipelines.yaml"),
                     "--model", str(ROOT / "configs/models/tiny.yaml"),
                     "--cluster", str(ROOT / "configs/clusters/spot-4.yaml"),
                     "--save-interval", "4", "--autohet-local-ckpt-dir", str(tmp_path / "ckpt")],
            "show": ["show", str(ROOT / "configs/plans/tiny-homogeneous.yaml")]}[command]
    code = ("import atexit, sys\n"
            "import torch.distributed.run\n"
            "torch.distributed.run.run = lambda args: None      # no agent: the job 'ended'\n"
            "atexit.register(print, 'finalized', flush=True)\n"
            "from megatron_autohet.cli.main import main\n"
            f"sys.argv = ['autohet', *{args!r}]\n"
            "sys.exit(main())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert ("finalized" in done.stdout) is finalized, done.stdout[-2000:]
