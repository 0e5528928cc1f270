"""The import contract: layers that only import down, and no cycle among the library's modules.

A module may import modules of its own layer and of the layers below it, at the top of the file or inside a
function alike (an import inside a function is for an optional dependency, not for hiding a cycle)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"medusa_heads": ROOT / "medusa_heads", "medusa_heads.tree": ROOT / "tree",
           "medusa_heads.inference": ROOT / "inference", "medusa_heads.training": ROOT / "training",
           "medusa_heads.configs": ROOT / "configs"}

# Top first. A module belongs to the layer of the longest prefix that names it.
LAYERS = [
    ("command line", ["medusa_heads.cli"]),
    ("tools", ["medusa_heads.training", "medusa_heads.bench"]),
    ("api", ["medusa_heads.model", "medusa_heads.loading", "medusa_heads"]),
    ("measurement", ["medusa_heads.calibration"]),
    ("algorithm", ["medusa_heads.inference"]),
    ("engines", ["medusa_heads.engines", "medusa_heads.llamacpp"]),
    ("kernels", ["medusa_heads.kernels"]),
    ("core", ["medusa_heads.tree", "medusa_heads.heads", "medusa_heads.config", "medusa_heads.checkpoint",
              "medusa_heads.corpus", "medusa_heads.prompting", "medusa_heads.shards", "medusa_heads.default_model",
              "medusa_heads.local_server", "medusa_heads.configs", "medusa_heads.faults"]),
    ("machine", ["medusa_heads.machine"]),
]


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            if package == "medusa_heads" and path.relative_to(folder).parts[0] in ("default_heads",):
                continue
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def layer(module: str) -> int:
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    assert rank is not None, f"{module} is in no layer: add it to LAYERS"
    return rank


def imports(path: Path, module: str, known: set[str]) -> list[tuple[str, int, bool]]:
    """(imported library module, line, at the top level) for every import of a library module in `path`."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module and name.startswith("medusa_heads"):
                out.append((name, node.lineno, id(node) in top or _guarded(tree, node)))
    return sorted(set(out))


def _guarded(tree: ast.Module, node: ast.AST) -> bool:
    """An import under `if TYPE_CHECKING:` at the top level counts as a top-level one."""
    return any(isinstance(n, ast.If) and node in ast.walk(n) for n in tree.body)


def test_imports_point_down_only():
    known = modules()
    up = []
    for module, path in sorted(known.items()):
        for name, line, _ in imports(path, module, known):
            if layer(name) < layer(module) and not module.startswith(name + "."):
                up.append(f"{path.relative_to(ROOT)}:{line}: {module} ({LAYERS[layer(module)][0]}) imports {name} "
                          f"({LAYERS[layer(name)][0]})")
    assert not up, "imports that point up:\n" + "\n".join(up)


def test_no_import_cycle():
    known = modules()
    graph = {m: {n for n, _, top in imports(p, m, known) if top} for m, p in known.items()}
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(m: str, stack: list[str]) -> bool:
        state[m] = 1
        for n in graph.get(m, ()):
            if m.startswith(n + "."):  # a package's own __init__ runs first: not a cycle
                continue
            if state.get(n) == 1:
                cycle.extend(stack[stack.index(n):] + [n] if n in stack else [m, n])
                return True
            if n not in state and visit(n, stack + [n]):
                return True
        state[m] = 2
        return False

    for m in sorted(graph):
        if m not in state and visit(m, [m]):
            break
    assert not cycle, " -> ".join(cycle)


@pytest.mark.parametrize("module", ["medusa_heads.tree", "medusa_heads.machine"])
def test_the_bottom_layers_never_see_a_model(module):
    known = modules()
    for name, path in known.items():
        if name == module or name.startswith(module + "."):
            text = path.read_text()
            assert "PreTrainedModel" not in text and "medusa_heads.inference" not in text, name


def test_every_package_is_installed():
    """A wheel holds the packages pyproject.toml lists, and only those: every package folder of the library is one
    (an editable install finds an unlisted one anyway, so only this test sees it missing)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {name for name, path in modules().items() if path.name == "__init__.py"}
    assert found == listed, f"packages missing from pyproject.toml: {sorted(found - listed)}; listed, not found: " \
                            f"{sorted(listed - found)}"
