"""The package's import graph, read with ``ast`` (module-level and function-local imports alike):
no cycle, no import down the layers, and a function-local import only where it keeps an optional
heavy dependency out of its module's import, saying so in a comment.

Layers (megatron_autohet/__init__.py): a module imports its own package and the layers before
its own in :data:`LAYERS`, never a later one. The order is the data flow's (spec -> profiling ->
cost model -> planner -> plan -> runtime -> checkpoint -> elastic -> launch -> cli) with three
kinds of module placed before their readers: the plan file's dataclasses and the parameter
layout, which the cost model and the planner build; the runtime's layers, which the profiler
measures; and job.py, the one assembly of a training job, which both launchers share.
"""

import ast
from pathlib import Path

import pytest

import megatron_autohet

pytestmark = pytest.mark.unit

PACKAGE = Path(megatron_autohet.__file__).parent
NAME = "megatron_autohet"

# Earliest first; the components of one entry may not import each other.
LAYERS = (
    {"__init__", "errors", "known_warnings", "system"},
    {"spec"},
    {"plan"},
    {"layout"},
    {"data"},
    {"runtime"},
    {"profiling"},
    {"cost_model"},
    {"planner"},
    {"checkpoint"},
    {"job"},
    {"plan_switch"},
    {"elastic"},
    {"launch"},
    {"megatron"},             # the front end in Megatron-LM's pretrain_gpt.py
    {"cli"},                  # `autohet`: `autohet torchrun` runs the checks of the megatron one
    {"testing"},              # oracles, for tests and scripts: nothing in the product imports it
)

# Optional or heavy dependencies a function may import to keep them out of its module's import
# (`autohet --help` and the planner start without torch; pyscipopt, boto3 and matplotlib are
# needed by one command each; moto by the tests' S3 server; wandb, optional, by --wandb-project;
# tensorboard by the rank that writes event files).
HEAVY = {"torch", "megatron", "transformer_engine", "apex", "pyscipopt", "boto3", "botocore",
         "matplotlib", "moto", "wandb", "tensorboard"}


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = (NAME, *path.relative_to(PACKAGE).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


class _Import:
    def __init__(self, module: str, node: ast.stmt, function: str | None, commented: bool):
        self.module, self.node, self.function, self.commented = module, node, function, commented
        self.targets = _targets(module, node)

    def __str__(self) -> str:
        return f"{MODULES[self.module].relative_to(PACKAGE.parent)}:{self.node.lineno}"


def _targets(module: str, node: ast.stmt) -> list[str]:
    """What ``node`` imports: a module of the package where it names one, else the name."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        here = module.split(".")
        if not MODULES[module].name == "__init__.py":
            here = here[:-1]
        base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]


def _commented(lines: list[str], body: list[ast.stmt], index: int) -> bool:
    """The import at ``body[index]`` says why it is there: a comment on a line of its run of
    consecutive imports, or on the line just before the run."""
    start = end = index
    while start > 0 and isinstance(body[start - 1], (ast.Import, ast.ImportFrom)):
        start -= 1
    while end + 1 < len(body) and isinstance(body[end + 1], (ast.Import, ast.ImportFrom)):
        end += 1
    first, last = body[start].lineno, body[end].end_lineno
    if any("#" in line for line in lines[first - 1:last]):
        return True
    above = first - 2
    while above >= 0 and not lines[above].strip():
        above -= 1
    return above >= 0 and lines[above].strip().startswith("#")


def _type_checking_only(node: ast.AST) -> bool:
    test = getattr(node, "test", None) if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports() -> list[_Import]:
    found = []
    for module, path in MODULES.items():
        source = path.read_text()
        lines = source.splitlines()

        def visit(node: ast.AST, function: str | None) -> None:
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                body = getattr(node, field, None)
                if not isinstance(body, list):
                    continue
                for index, child in enumerate(body):
                    if isinstance(child, (ast.Import, ast.ImportFrom)):
                        found.append(_Import(module, child, function,
                                             _commented(lines, body, index)))
                    elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        visit(child, child.name)
                    elif _type_checking_only(child):
                        # ``if TYPE_CHECKING:`` imports never run: annotations only
                        visit(ast.Module(body=child.orelse, type_ignores=[]), function)
                    else:
                        visit(child, function)

        visit(ast.parse(source), None)
    return found


IMPORTS = _imports()


def _own(target: str) -> str | None:
    """The package's module ``target`` names or lies in, or None for another distribution."""
    while target not in MODULES and "." in target:
        target = target.rsplit(".", 1)[0]
    return target if target in MODULES else None


def _component(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer(component: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if component in layer)


def _heavy_at_import(module: str) -> set[str]:
    """The heavy distributions importing ``module`` imports (its packages' ``__init__`` too)."""
    seen, todo, heavy = set(), [module], set()
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        parts = current.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        for imp in IMPORTS:
            if imp.module != current or imp.function is not None:
                continue
            for target in imp.targets:
                own = _own(target)
                if own is not None:
                    todo.append(own)
                elif target.split(".")[0] in HEAVY:
                    heavy.add(target.split(".")[0])
    return heavy


def _target_heavy(target: str) -> set[str]:
    own = _own(target)
    if own is not None:
        return _heavy_at_import(own)
    return {target.split(".")[0]} & HEAVY


def test_every_component_has_a_layer():
    components = {_component(m) for m in MODULES}
    assert sorted(c for c in components if not any(c in layer for layer in LAYERS)) == []


def test_no_import_goes_down_the_layers():
    wrong = []
    for imp in IMPORTS:
        for target in imp.targets:
            own = _own(target)
            if own is None:
                continue
            here, there = _component(imp.module), _component(own)
            if here != there and _layer(there) >= _layer(here):
                wrong.append(f"{imp}: {imp.module} imports {own}")
    assert wrong == []


def test_product_code_never_imports_the_oracles():
    """megatron_autohet/testing/ (reference, stock baseline, exhaustive planner, emulator...) is
    for tests and scripts: a product module importing it would ship an oracle as product."""
    wrong = [f"{imp}: {t}" for imp in IMPORTS if _component(imp.module) != "testing"
             for t in imp.targets if (_own(t) or "").startswith(f"{NAME}.testing")]
    assert wrong == []


def test_the_module_graph_has_no_cycle():
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for imp in IMPORTS:
        for target in imp.targets:
            own = _own(target)
            if own is not None and own != imp.module:
                edges[imp.module].add(own)
    cycles, state = [], {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for nxt in sorted(edges[module]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(path[path.index(nxt):] + [module, nxt]))
            elif nxt not in state:
                visit(nxt, path + [module])
        state[module] = "done"

    for module in sorted(MODULES):
        if module not in state:
            visit(module, [])
    assert cycles == []


def test_function_local_imports_keep_a_heavy_dependency_out_and_say_so():
    """A function-local import is there only for what its module does not import anyway:
    torch / megatron-core (e.g. the CLI's start-up), pyscipopt, boto3, matplotlib."""
    needless, silent = [], []
    for imp in IMPORTS:
        if imp.function is None:
            continue
        deferred = set().union(*(_target_heavy(t) for t in imp.targets))
        if not deferred - _heavy_at_import(imp.module):
            needless.append(f"{imp} ({imp.function}): {', '.join(imp.targets)}")
        elif not imp.commented:
            silent.append(f"{imp} ({imp.function}): {', '.join(imp.targets)}")
    assert needless == [], "move these imports to the top of their module"
    assert silent == [], "say in a comment why these imports are inside a function"


def test_no_test_module_imports_another():
    """Tests share code through tests/helpers/ only: a test module imported by another would
    run its tests' module-level set-up twice and tie two areas of the tree together."""
    tests = Path(__file__).parent
    names = {p.stem for p in tests.rglob("test_*.py")}
    offenders = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module]
            else:
                continue
            offenders += [f"{path.relative_to(tests)}: {t}" for t in targets
                          if t.split(".")[-1] in names or t.startswith("tests.")]
    assert offenders == [], "move what they share into tests/helpers/"
