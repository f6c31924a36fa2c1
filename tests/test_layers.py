"""The package's layers (docs/architecture.md): a module imports only from its own part of the tree or from the
parts below it, and only the loader imports the native library."""
import ast
import pathlib

import hydra_torch

PACKAGE = pathlib.Path(hydra_torch.__file__).parent

# Bottom to top. A part is a subpackage or a top-level module ("__init__": the package itself, ht).
LAYERS = [
    {"_loader"},
    {"ops", "testing", "recipe", "models"},
    {"task", "task_checks"},
    {"state", "report"},
    {"run"},
    {"selection"},
    {"api", "planning"},
    {"optuna", "cluster"},
    {"optim", "arrivals"},  # public paths kept as re-exports of recipe/ and selection/
    {"__init__"},
    {"demo"},               # the main job, written against ht as a user's program is
    {"corpus"},             # a public path kept as a re-export of demo/
]
LAYER = {part: i for i, parts in enumerate(LAYERS) for part in parts}


def _part(module: str) -> str:
    names = module.split(".")
    return names[1] if len(names) > 1 else "__init__"


def _imports():
    """(importing module, imported module) for every import of hydra_torch in the package, lazy ones included."""
    for path in sorted(PACKAGE.rglob("*.py")):
        names = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        module = ".".join(names[:-1] if names[-1] == "__init__" else names)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{alias.name}" if node.module == "hydra_torch" else node.module
                           for alias in node.names]
            else:
                continue
            for target in targets:
                if target.split(".")[0] == "hydra_torch":
                    yield module, target


def test_every_part_has_a_layer():
    parts = {path.stem if path.is_file() else path.name for path in PACKAGE.iterdir()
             if (path.suffix == ".py" or (path / "__init__.py").is_file())}
    assert parts == set(LAYER), "give each new part of the package its place in LAYERS and docs/architecture.md"


def test_imports_go_down():
    upward = [f"{module} imports {target}" for module, target in _imports()
              if _part(target) != "_C" and _part(module) != _part(target)
              and LAYER[_part(target)] >= LAYER[_part(module)]]
    assert not upward


def test_only_the_loader_imports_the_native_library():
    assert {module for module, target in _imports() if _part(target) == "_C"} == {"hydra_torch._loader"}
