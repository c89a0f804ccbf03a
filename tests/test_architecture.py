"""The floors of docs/architecture.md: a module imports only from its own package and the floors below it."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "jdp"
FLOOR = {"accounting": 1, "noise": 1, "sampling": 1, "validation": 1, "data": 1, "metrics": 1, "plots": 1,
         "hostmem": 1, "clipping": 2, "multitask": 2, "selection": 2, "altmin": 3, "seqrec": 3, "meta": 3,
         "audit": 4, "cli_support": 5, "demo": 5, "cli": 5}


def _package(path: pathlib.Path) -> str:
    return path.relative_to(ROOT).parts[0].removesuffix(".py")


def _imports(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jdp."):
            yield node.module.split(".")[1]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("jdp."):
                    yield alias.name.split(".")[1]


def test_every_module_imports_only_its_floor_and_below():
    bad = []
    for path in ROOT.rglob("*.py"):
        if path.name == "__init__.py" and path.parent == ROOT:
            continue
        own = _package(path)
        assert own in FLOOR, f"{own} has no floor in docs/architecture.md"
        is_command = path.name == "cli.py"   # a package's CLI is a command: floor 5
        floor = 5 if is_command else FLOOR[own]
        for dep in _imports(path):
            if dep != own and dep in FLOOR and (FLOOR[dep] > floor or (FLOOR[dep] == floor and not is_command
                                                                        and floor > 1 and dep not in ("cli_support",))):
                bad.append(f"{path.relative_to(ROOT.parent)} imports jdp.{dep}")
    assert not bad, bad
