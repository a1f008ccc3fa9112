"""Write the names the oldest supported torch offers in the namespaces megatron-autohet calls.

tests/test_torch_api.py checks every ``torch.distributed`` / ``torch.cuda`` name the code uses
against this list, so a name that only newer torch releases have (``dist.all_gather_single``
came after 2.11) fails a CPU test instead of a job on the GPU machine. Regenerate it with the
oldest supported torch (setup.py) after adding a namespace below:

    /path/to/torch-2.11-venv/bin/python scripts/torch_api_list.py tests/fixtures/torch-2.11-api.txt

Every name of each namespace is listed (private ones too: a private name is no more stable
across releases than a public one), dunder names excepted; one ``namespace.name`` per line.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

import torch

# The namespaces the code imports from or calls into (tests/test_torch_api.py refuses a use
# under torch.distributed / torch.cuda whose namespace prefix is not here beyond the two roots).
NAMESPACES = (
    "torch.cuda",
    "torch.cuda.random",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.distributed_c10d",
    "torch.distributed.elastic.multiprocessing.api",
    "torch.distributed.elastic.multiprocessing.errors",
    "torch.distributed.launcher.api",
    "torch.distributed.run",
)


def api_names(namespaces: tuple[str, ...] = NAMESPACES) -> list[str]:
    """``namespace.name`` of every non-dunder attribute of each namespace, sorted. Every
    namespace is imported first, so a package lists the submodules the others import, as it
    does in a process that imported them."""
    modules = [importlib.import_module(name) for name in namespaces]
    return sorted(f"{module.__name__}.{name}" for module in modules for name in dir(module)
                  if not (name.startswith("__") and name.endswith("__")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the list to write, e.g. tests/fixtures/torch-2.11-api.txt")
    out = Path(parser.parse_args().out)
    version = torch.__version__.split("+")[0]
    lines = [f"# torch {version}: scripts/torch_api_list.py", *api_names()]
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, out)
    print(f"wrote {len(lines) - 1} names of torch {version} to {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
