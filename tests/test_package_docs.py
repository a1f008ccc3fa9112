"""The package's own map stays true: every package's docstring names each of its modules, and
docs/architecture.md each module file, so a newcomer finds every piece from either place."""

import ast
import re
from pathlib import Path

import pytest

import megatron_autohet

pytestmark = pytest.mark.unit

PACKAGE = Path(megatron_autohet.__file__).parent
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
PACKAGES = sorted(p.parent for p in PACKAGE.glob("*/__init__.py"))


def _modules(package: Path) -> list[str]:
    return sorted(p.stem for p in package.glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_every_package_docstring_names_each_of_its_modules(package):
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    missing = [m for m in _modules(package) if not re.search(rf"(?<![\w.]){m}\b", doc)]
    assert not missing, f"{package.name}/__init__.py's docstring does not name {missing}"


def test_the_architecture_map_names_every_module():
    text = ARCHITECTURE.read_text()
    files = [p.relative_to(PACKAGE) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"]
    missing = [str(f) for f in files if not re.search(rf"(?<![\w.]){re.escape(f.name)}", text)]
    assert not missing, f"docs/architecture.md does not name {missing}"
