"""The package's layout stays walkable (docs/ARCHITECTURE.md): no import cycle, no module over 400 lines, no class over
200 lines, and every design reference in the code resolves inside the repository."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"fastmae": ROOT / "fastmae", "fastmae.kernels": ROOT / "kernels"}
MAX_MODULE_LINES, MAX_CLASS_LINES = 400, 200


def modules() -> dict[str, Path]:
    """Every module of the installed package by dotted name (kernels/ installs as fastmae.kernels)."""
    found = {}
    for package, directory in PACKAGES.items():
        for path in sorted(directory.rglob("*.py")):
            parts = path.relative_to(directory).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def _type_checking_only(node: ast.AST, parents: dict) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that `name` imports anywhere in its file (lazy imports too; TYPE_CHECKING ones not)."""
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    targets = set()
    for node in ast.walk(tree):
        if _type_checking_only(node, parents):
            continue
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from package import module` imports the module; `from module import name` the module
            targets |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names}
    return {target for target in targets if target in known and target != name}


def test_no_import_cycle():
    found = modules()
    graph = {name: imports_of(name, path, set(found)) for name, path in found.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                cycle = path[path.index(target):] + [target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, path + [target])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert graph["fastmae.pretrained"] >= {"fastmae.hf"}  # the walk sees imports


def test_modules_and_classes_stay_small():
    """The package's modules and the scripts beside it (benchmarks/, scripts/) alike."""
    too_long = []
    scripts = {str(path): path for folder in ("benchmarks", "scripts") for path in sorted((ROOT / folder).glob("*.py"))}
    for name, path in {**modules(), **scripts}.items():
        text = path.read_text()
        if text.count("\n") > MAX_MODULE_LINES:
            too_long.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                too_long.append(f"{path.relative_to(ROOT)}: class {node.name}, {node.end_lineno - node.lineno + 1} "
                                "lines")
    assert not too_long, too_long


def test_design_references_resolve_inside_the_repository():
    """Code cites the architecture document as `ARCHITECTURE.md section N` (docs/ARCHITECTURE.md), never a file
    outside the repository."""
    sections = set(re.findall(r"^## (\d+)\.", (ROOT / "docs" / "ARCHITECTURE.md").read_text(), re.M))
    bad = []
    for path in [*ROOT.glob("fastmae/**/*.py"), *ROOT.glob("kernels/*.py"), *ROOT.glob("benchmarks/*.py"),
                 *ROOT.glob("scripts/*"), *ROOT.glob("configs/*")]:
        if not path.is_file():  # scripts/__pycache__, where Python wrote one
            continue
        text = path.read_text()
        if "DESIGN.md" in text:
            bad.append(f"{path.relative_to(ROOT)} cites DESIGN.md")
        for cited in re.findall(r"ARCHITECTURE\.md,? sections? ([\d, and]+)", text):
            bad += [f"{path.relative_to(ROOT)}: no section {n}" for n in re.findall(r"\d+", cited)
                    if n not in sections]
    assert sections and not bad, bad


def test_setup_installs_every_package():
    """A non-editable install ships only the packages setup.py names: every directory of the package is one."""
    listed = set(re.search(r"packages=\[([^\]]*)\]", (ROOT / "setup.py").read_text()).group(1).replace('"', "")
                 .replace(" ", "").split(","))
    packages = {name for name, path in modules().items() if path.name == "__init__.py"}
    assert packages == listed, (packages, listed)


@pytest.mark.xdist_group("layout")
def test_grouped_tests_stay_grouped_under_loadgroup(request):
    """Under `-n 2 --dist loadgroup` (scripts/test.sh) pytest-xdist keeps an xdist_group on one worker by tagging its
    tests' ids with the group; where it cannot (pytest 9.2 with xdist 3.8), the tests sharing an expensive run
    (a module fixture of 2-rank launches) would repeat it on both workers."""
    if not getattr(request.config.option, "loadgroup", False):  # set on the workers of --dist loadgroup
        pytest.skip("the suite's own command runs under --dist loadgroup")
    assert request.node.nodeid.endswith("@layout"), request.node.nodeid


def test_every_commands_help_opens_with_its_docstrings_whole_first_paragraph():
    """A `--help` description taken from the module docstring's first line is its whole first paragraph (a dozen
    benchmarks and scripts cut their sentence there mid-way)."""
    files = [*modules().values(), *(ROOT / "benchmarks").glob("*.py"), *(ROOT / "scripts").glob("*.py")]
    cut = []
    for path in files:
        if "__doc__.splitlines()[0]" in (text := path.read_text()):
            doc = ast.get_docstring(ast.parse(text), clean=False)
            cut += [] if doc.splitlines()[0] == doc.split("\n\n")[0] else [str(path.relative_to(ROOT))]
    assert not cut, cut
