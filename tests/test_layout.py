"""The package's layout holds: no import circles anywhere in it (imports inside functions
count too), the runtime never imports the tools or the apps above it, mlx_eagle is the
only package installed, and every documented entry point is a module that exists."""

import ast
import re
import tomllib
from pathlib import Path
from typing import Dict, Set

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mlx_eagle"
# What the runtime (target, drafters, trees, verify, decoder, generation, plan) must not reach.
TOOLS_AND_APPS = ("mlx_eagle.bench", "mlx_eagle.tune", "mlx_eagle.train", "mlx_eagle.chat", "mlx_eagle.server")
RUNTIME = ("mlx_eagle.target", "mlx_eagle.trees", "mlx_eagle.verify", "mlx_eagle.decoder", "mlx_eagle.prompt_cache",
           "mlx_eagle.prompt_store",
           "mlx_eagle.generate", "mlx_eagle.generation", "mlx_eagle.scheduler",
           "mlx_eagle.plan", "mlx_eagle.drafters", "mlx_eagle.costs", "mlx_eagle.heads",
           "mlx_eagle.models", "mlx_eagle.engine", "mlx_eagle.session", "mlx_eagle.options", "mlx_eagle.architectures",
           "mlx_eagle.compiled",
           "mlx_eagle.blas", "mlx_eagle.configs")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> Dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports(name: str, path: Path, known: Set[str]) -> Set[str]:
    """The package modules ``name`` imports, anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph() -> Dict[str, Set[str]]:
    found = modules()
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def test_no_module_imports_itself_through_others():
    edges = graph()
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(node):  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in edges[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in edges:
        if node not in index:
            visit(node)
    assert circles == [], circles


def test_the_runtime_never_imports_the_tools_or_apps():
    edges = graph()
    reach = {}

    def reachable(node, seen):
        for other in edges[node]:
            if other not in seen:
                seen.add(other)
                reachable(other, seen)
        return seen

    for name in edges:
        if name.startswith(RUNTIME):
            reach[name] = {m for m in reachable(name, set()) if m.startswith(TOOLS_AND_APPS)}
    assert {name: found for name, found in reach.items() if found} == {}


def test_mlx_eagle_is_the_only_installed_package_and_every_script_exists():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["tool"]["setuptools"]["packages"]["find"]["include"] == ["mlx_eagle*"]
    known = modules()
    for script, target in project["project"]["scripts"].items():
        module, _, function = target.partition(":")
        assert module in known, script
        assert re.search(rf"^def {function}\(", known[module].read_text(), re.M), script


def test_every_python_m_path_in_the_readme_is_a_module():
    known = modules()
    documented = set(re.findall(r"python -m (mlx_eagle[\w.]*)", (ROOT / "README.md").read_text()))
    assert documented
    for name in documented:
        assert name in known or f"{name}.__main__" in known, name


def test_ci_runs_the_readme_quick_start_in_its_order():
    """README's two commands, as a new user runs them: command 1, then command 2 (CI may add
    flags to the test command, and lints in between)."""
    quick_start = (ROOT / "README.md").read_text().split("## Quick start", 1)[1]
    commands = re.search(r"```sh\n(.*?)```", quick_start, re.S).group(1).strip().splitlines()
    assert len(commands) == 2 and "mlx_eagle.generate" in commands[0] and "pytest" in commands[1]
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("./setup.sh")]
    assert ci[0] == commands[0] and ci[1].startswith(commands[1])


def test_the_drafter_protocol_imports_no_model_code():
    """Writing a drafter needs the protocol, the tree data and Composite, not mlx-lm or
    transformers (which take seconds to import): how a head grows trees lives with it."""
    import subprocess
    import sys

    check = ("import sys; import mlx_eagle.trees, mlx_eagle.drafters, mlx_eagle.drafters.composite; "
             "from mlx_eagle import Drafter, Proposal, Budget, Outcome; "
             "print([m for m in sys.modules if m.split('.')[0] in ('mlx_lm', 'transformers')])")
    loaded = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=ROOT, check=True)
    assert loaded.stdout.strip() == "[]", loaded.stdout


# Function-local imports kept for a reason other than --help's speed: (module, what it imports) -> why.
LOCAL_IMPORTS_FOR_A_REASON = {
    ("mlx_eagle.chat", "readline"): "imported for its effect on input() (line editing), only when the app starts",
}
SLOW_IMPORTS = ("mlx_lm", "transformers", "matplotlib")  # what takes a second or more to import


def top_level_imports() -> Dict[str, Set[str]]:
    """Each module's imports at its top level (package modules and third-party roots)."""
    found = modules()
    known = set(found)
    result = {}
    for name, path in found.items():
        body = ast.parse(path.read_text()).body
        top = set()
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                top |= resolved(name, path, node, known)
        result[name] = top
    return result


def resolved(name: str, path: Path, node: ast.AST, known: Set[str]) -> Set[str]:
    """The package modules an import statement names, or the third-party package's root."""
    if isinstance(node, ast.ImportFrom) and not node.level and not (node.module or "").startswith("mlx_eagle"):
        return {node.module.split(".")[0]}
    if isinstance(node, ast.Import) and not node.names[0].name.startswith("mlx_eagle"):
        return {alias.name.split(".")[0] for alias in node.names}
    module = ast.Module(body=[node], type_ignores=[])
    return imports_of(name, path, module, known)


def imports_of(name: str, path: Path, tree: ast.AST, known: Set[str]) -> Set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        for alias in node.names:
            target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def loads_model_code(name: str, top: Dict[str, Set[str]], seen: Set[str]) -> bool:
    """Whether importing ``name`` imports mlx-lm, transformers or matplotlib (its packages
    run too)."""
    if not name.startswith("mlx_eagle"):
        return name in SLOW_IMPORTS
    if name in seen:
        return False
    seen.add(name)
    parents = {name.rsplit(".", i)[0] for i in range(1, name.count(".") + 1)}
    return any(loads_model_code(other, top, seen) for other in top.get(name, set()) | parents)


def is_command(name: str, path: Path) -> bool:
    """A module run as a command (python -m), or the package such a ``__main__`` is in (imported
    first): it must import light."""
    return path.name == "__main__.py" or 'if __name__ == "__main__"' in path.read_text() or \
        (path.name == "__init__.py" and (path.parent / "__main__.py").exists())


def test_dependencies_are_imported_at_the_top_of_each_module():
    """A function-local import hides a dependency; one is kept only in a command's module,
    of what loads mlx-lm, transformers or matplotlib, so that --help answers at once (or for a reason
    named in LOCAL_IMPORTS_FOR_A_REASON)."""
    found = modules()
    known, top = set(found), top_level_imports()
    hidden = []
    for name, path in found.items():
        tree = ast.parse(path.read_text())
        functions = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for function in functions:
            for node in ast.walk(function):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                for target in resolved(name, path, node, known):
                    if (name, target) in LOCAL_IMPORTS_FOR_A_REASON:
                        continue
                    if not (is_command(name, path) and loads_model_code(target, top, set())):
                        hidden.append(f"{name}:{node.lineno} {function.name} imports {target}")
    assert hidden == []


def test_loading_a_model_knows_no_drafter():
    """models.py (finding, converting and loading targets) sits below the drafters, which
    load draft models through it: it imports no plan, drafter, decoder or app."""
    above = ("mlx_eagle.plan", "mlx_eagle.drafters", "mlx_eagle.decoder", "mlx_eagle.generate", "mlx_eagle.engine",
             "mlx_eagle.session")
    assert [m for m in graph()["mlx_eagle.models"] if m.startswith(above)] == []


def test_benchmarks_results_holds_what_the_docs_cite():
    """Every file in benchmarks/results is cited by path in README or docs/, and every path
    cited there exists (an --out stem counts for the files it writes)."""
    results = ROOT / "benchmarks" / "results"
    texts = [(ROOT / "README.md").read_text()] + [p.read_text() for p in (ROOT / "docs").glob("*.md")]
    cited = {m.rstrip(".") for text in texts for m in re.findall(r"benchmarks/results/[\w./-]+", text)}
    missing = sorted(c for c in cited if not (ROOT / c).is_file() and not list(ROOT.glob(c + ".*")))
    stored = {str(p.relative_to(ROOT)) for p in results.rglob("*") if p.is_file()}
    uncited = sorted(f for f in stored if f not in cited and f.rsplit(".", 1)[0] not in cited)
    assert (missing, uncited) == ([], [])


# The floors, lowest first: a module imports only from its own floor or below (anywhere in
# its file, function-local imports too). Drafter models sit beside heads.py, under the
# drafters that use them; loading a model (models.py) sits under the drafters that load
# draft models through it; the commands of convert/ sit with the tools.
FLOORS = [
    ("base", ("errors", "files", "progress", "blas", "cli", "configs", "architectures", "trees", "hub",
              "distributed")),
    ("model code and conversion", ("target", "rewind", "verify", "compiled", "costs", "heads", "dflash_model",
                                   "dspark_model", "mtp_model", "convert")),
    ("loading", ("models",)),
    ("drafting", ("drafters", "grammar", "thinking")),
    ("decoding", ("prompt_store", "prompt_cache", "node_odds", "decoder", "plan")),
    ("the API", ("options", "generation", "generate", "replies", "infill", "scheduler", "engine", "session")),
    ("tools and apps", ("", "generate.__main__", "convert.head", "convert.export", "bench", "tune", "train", "data",
                        "features", "chat", "protocols", "metrics", "server")),
]


def floor_of(name: str) -> int:
    """The floor of module ``name`` (mlx_eagle.X...): its longest listed prefix's."""
    relative = name[len("mlx_eagle."):] if name != "mlx_eagle" else ""
    best, floor = -1, None
    for index, (_, names) in enumerate(FLOORS):
        for listed in names:
            if (relative == listed or (listed and relative.startswith(listed + "."))) and len(listed) > best:
                best, floor = len(listed), index
    assert floor is not None, f"{name} is on no floor: add it to FLOORS"
    return floor


def test_no_import_runs_back_up_a_floor():
    found = modules()
    known = set(found)
    upward = [f"{name} ({FLOORS[floor_of(name)][0]}) imports {other} ({FLOORS[floor_of(other)][0]})"
              for name, path in found.items() for other in imports(name, path, known)
              if floor_of(other) > floor_of(name)]
    assert not upward, "\n".join(sorted(upward))


def test_the_architecture_doc_s_module_table_names_every_module_and_no_other():
    """docs/architecture.md's table of layers names each module of the package (a top-level
    module as `name.py`, a package as `name/`, the drafter kinds' modules too) and names no
    module that is not there."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = "\n".join(line for line in text.split("## One round")[0].splitlines() if line.startswith("|"))
    named = {name.rsplit("/", 1)[-1] for name in re.findall(r"`([\w/]+\.py)`", table)}
    files = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    top = {f for f in files if "/" not in f}
    missing = sorted(f for f in top | {f.split("/", 1)[1] for f in files if f.startswith("drafters/")}
                     if f not in named)
    assert not missing, f"docs/architecture.md's table does not name {missing}"
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert not [p for p in packages if f"`{p}/`" not in table], packages
    unknown = sorted(n for n in named if not any(f == n or f.endswith("/" + n) for f in files))
    assert not unknown, f"docs/architecture.md's table names modules that do not exist: {unknown}"
