"""Every torch.distributed / torch.cuda name the code uses exists in the oldest supported torch.

The list (tests/fixtures/torch-2.11-api.txt) is written by scripts/torch_api_list.py from a torch
2.11 install; the code is read with ``ast``, so the check runs with whatever torch is installed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parent.parent
API_LIST = ROOT / "tests" / "fixtures" / "torch-2.11-api.txt"
CHECKED_ROOTS = ("torch.distributed", "torch.cuda")
SCANNED = ("megatron_autohet", "scripts", "tests")


def load_api(path: Path = API_LIST) -> tuple[set[str], set[str]]:
    """(every listed ``namespace.name``, the namespaces listed)."""
    names = {line for line in path.read_text().splitlines() if line and not line.startswith("#")}
    namespaces = {name.rsplit(".", 1)[0] for name in names}
    return names, namespaces


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """``a.b.c`` with ``a`` resolved through the file's imports; None unless rooted at torch."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in aliases:
        return None
    return ".".join([aliases[node.id], *reversed(parts)])


def torch_uses(source: str) -> list[tuple[int, str]]:
    """(line, dotted name) of each torch name a module imports or reaches by attribute. Imports
    are collected file-wide (function-local ones included): the code binds each alias one way."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}
    uses: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    # ``import torch.x`` binds torch; ``import torch.x as y`` binds torch.x
                    aliases[alias.asname or "torch"] = alias.name if alias.asname else "torch"
                    uses.append((node.lineno, alias.name))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "torch":
            for alias in node.names:
                dotted = f"{node.module}.{alias.name}"
                aliases[alias.asname or alias.name] = dotted
                uses.append((node.lineno, dotted))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            dotted = _dotted(node, aliases)
            if dotted:
                uses.append((node.lineno, dotted))
    return uses


def missing(dotted: str, names: set[str], namespaces: set[str]) -> str | None:
    """Why ``dotted`` is not in the list, or None. Its longest listed namespace prefix decides:
    the component after it must be listed there (deeper ones, ``ReduceOp.MAX``, are members of
    a listed class or of an unlisted module the listed name stands for)."""
    if not dotted.startswith(CHECKED_ROOTS) or dotted in namespaces:
        return None
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:cut])
        if prefix in namespaces:
            name = f"{prefix}.{parts[cut]}"
            return None if name in names else f"{name} is not in torch 2.11"
    return f"{dotted}: no listed namespace (add one to scripts/torch_api_list.py)"


def scanned_files() -> list[Path]:
    return sorted(path for top in SCANNED for path in (ROOT / top).rglob("*.py"))


@pytest.mark.unit
def test_list_covers_the_checked_roots():
    names, namespaces = load_api()
    assert set(CHECKED_ROOTS) <= namespaces
    assert "torch.distributed.all_gather_into_tensor" in names


@pytest.mark.integration
def test_code_uses_only_torch_2_11_names():
    names, namespaces = load_api()
    problems = [f"{path.relative_to(ROOT)}:{line}: {why}"
                for path in scanned_files()
                for line, dotted in torch_uses(path.read_text())
                if (why := missing(dotted, names, namespaces))]
    assert not problems, "\n".join(problems)


@pytest.mark.unit
@pytest.mark.parametrize("source, bad", [
    ("import torch.distributed as dist\ndist.all_gather_single(a, b)\n",
     "torch.distributed.all_gather_single"),
    ("import torch\ntorch.distributed.reduce_scatter_single(a, b)\n",
     "torch.distributed.reduce_scatter_single"),
    ("def f():\n    from torch.distributed import all_gather_single\n",
     "torch.distributed.all_gather_single"),
    ("from torch import cuda\ncuda.no_such_call()\n", "torch.cuda.no_such_call"),
    ("import torch.distributed.checkpoint as dcp\ndcp.no_such_call()\n",
     "torch.distributed.checkpoint.no_such_call"),
])
def test_a_name_newer_than_2_11_is_caught(source, bad):
    names, namespaces = load_api()
    found = [why for _, dotted in torch_uses(source)
             if (why := missing(dotted, names, namespaces))]
    assert found and all(bad in why for why in found)


@pytest.mark.unit
def test_names_present_in_2_11_pass():
    names, namespaces = load_api()
    source = ("import torch\nimport torch.distributed as dist\n"
              "dist.all_gather_into_tensor(a, b)\ndist.ReduceOp.MAX\n"
              "torch.cuda.random.get_rng_state()\ntorch.cuda.is_available()\n"
              "from torch.distributed.checkpoint import FileSystemReader\n")
    assert not [d for _, d in torch_uses(source) if missing(d, names, namespaces)]
