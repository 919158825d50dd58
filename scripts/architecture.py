#!/usr/bin/env python3
"""The architecture as contracts, checked in the lint session (``python3 scripts/dev.py lint``).

1. No import circles, module by module, in either package (imports under ``TYPE_CHECKING`` and inside
   functions count too): grimp's import graph, strongly connected components of size one only.
2. Each package's layers (``LAYERS``, top to bottom): a module may import from its own layer's
   subpackage and from layers below, never from one above; subpackages that share a layer (``|``)
   do not import each other.
3. Sizes: no file over ``MAX_FILE`` lines, no function over ``MAX_FUNCTION``, no class over ``MAX_CLASS``
   counted with the module functions whose first parameter is annotated with it (a module function whose
   first parameter has no annotation is flagged), ``create_app`` at most ``MAX_CREATE_APP``, every module
   of ``api/`` at most ``MAX_API_MODULE`` lines and each route function in it at most ``MAX_ROUTE``; the
   few breaches allowed are named in ``SIZE_EXCEPTIONS`` with their reasons.
4. No ``getattr``/``hasattr`` on an engine outside ``engine/``: ``Engine`` declares what engines can do.
5. Every public name (each package's ``__all__``) has a docstring of its own: the API reference of the
   documentation site (``mkdocs.yml``) is generated from them.
6. Tests mirror modules: each module of the server's ``MIRRORED`` subpackages has
   ``tests/server/<subpackage>/test_<module>.py``; each subpackage of the client has its folder of tests,
   ``tests/client/<subpackage>/``.

Prints what breaks a contract and how to mend it; exits 1 if anything does.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent
SOURCES = {
    "agentjet_server": ROOT / "packages" / "agentjet-server" / "src" / "agentjet_server",
    "agentjet_client": ROOT / "packages" / "agentjet-client" / "src" / "agentjet_client",
}
# top to bottom; names are subpackages or modules of agentjet_server; "a | b": independent siblings
SERVER_LAYERS = [
    "__main__",
    "cli",
    "admin_cli | launch",
    "admin_client | starting",
    "app",
    "api",
    "runtime",
    "control | admission | tinker",
    "state | embedded | memory",
    "learner | serving",
    "observe",
    "ingest",
    "batching",
    "engine",
    "connections | settings | errors | versions | model_shape",
    "option_groups",
]
# the client: the commands over the services (research, gateway, fine-tuning), a run over delivery and the
# environments, the client facade over capture and the tasks, the wire and the plain helpers at the bottom
CLIENT_LAYERS = [
    "__main__",
    "cli",
    "research | gateway | finetune",
    "run",
    "delivery | envs",
    "client",
    "capture | tasks",
    "sandbox",
    "protocol | dialects | tracing | logs | failures",
    "errors | version",
]
LAYERS = {"agentjet_server": SERVER_LAYERS, "agentjet_client": CLIENT_LAYERS}
MAX_CLASS = 250  # counted with the module functions whose first parameter is annotated with the class
MAX_FUNCTION = 80
MAX_FILE = 600
# at most five, each with its reason (a breach not named here fails the lint)
SIZE_EXCEPTIONS: dict[str, str] = {
    "agentjet_server.serving.dialects.response_events": (
        "one streamed answer as Responses API events: an async generator whose open items (reasoning, text, "
        "tool calls) and event numbering are its own local state, which parts would have to pass around"
    ),
    "agentjet_server.serving.dialects.message_events": (
        "one streamed answer as Anthropic Messages events: the same kind of generator, its open content "
        "blocks and their indices its local state"
    ),
}
MAX_CREATE_APP = 60
MAX_API_MODULE = 250
MAX_ROUTE = 40


MIRRORED = ("api", "serving", "ingest", "state", "learner")


def test_mirror() -> list[str]:
    out = []
    client = SOURCES["agentjet_client"]
    for sub in sorted(p.parent.name for p in client.glob("*/__init__.py")):
        if not (ROOT / "tests" / "client" / sub).is_dir() and sub not in ("envs", "protocol"):
            out.append(f"agentjet_client/{sub}/ has no tests/client/{sub}/: the tests of its modules go there")
    for sub in MIRRORED:
        for path in sorted((SOURCES["agentjet_server"] / sub).glob("*.py")):
            test = ROOT / "tests" / "server" / sub / f"test_{path.stem}.py"
            if path.stem != "__init__" and not test.exists():
                out.append(f"agentjet_server/{sub}/{path.name} has no {test.relative_to(ROOT)}: its tests go there")
    return out


def import_circles(package: str) -> list[str]:
    """Every import circle among the package's modules (Tarjan's strongly connected components)."""
    graph = grimp.build_graph(package, include_external_packages=False)
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[str] = []

    def visit(node: str) -> None:  # iterative enough for our depth; the graph is small
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(edges[node]):
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
                circles.append(" <-> ".join(sorted(component)))

    sys.setrecursionlimit(10_000)
    for module in sorted(edges):
        if module not in index:
            visit(module)
    return circles


def layer_breaches(package: str) -> list[str]:
    layers = LAYERS[package]
    graph = grimp.build_graph(package, include_external_packages=False)
    where: dict[str, tuple[int, str]] = {}
    for depth, layer in enumerate(layers):
        for name in (part.strip() for part in layer.split("|")):
            where[name] = (depth, name)
    out = []
    for module in sorted(graph.modules):
        parts = module.split(".")
        if len(parts) < 2:
            continue  # the package root re-exports names lazily
        if parts[1] not in where:
            out.append(f"{module}: not in any layer of {package}'s LAYERS (scripts/architecture.py); place it")
            continue
        depth, unit = where[parts[1]]
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            target = imported.split(".")
            if len(target) < 2 or target[1] == unit:
                continue
            other_depth, other = where.get(target[1], (len(layers), target[1]))
            if other_depth < depth:
                out.append(f"{module} imports {imported}, a layer above it ({other} over {unit})")
            elif other_depth == depth:
                out.append(f"{module} imports {imported}: {unit} and {other} are independent siblings")
    return out


def _annotated_class(function: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """The class a module function's first parameter is annotated with (a plain or quoted name), if any."""
    params = function.args.posonlyargs + function.args.args
    if not params or params[0].annotation is None:
        return None
    annotation = params[0].annotation
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return annotation.value
    return annotation.id if isinstance(annotation, ast.Name) else None


def _span(node: ast.AST) -> int:
    return (getattr(node, "end_lineno", None) or node.lineno) - node.lineno + 1  # type: ignore[attr-defined]


def sizes() -> list[str]:
    out = []
    for package, source in SOURCES.items():
        for path in sorted(source.rglob("*.py")):
            module = ".".join([package, *path.relative_to(source).with_suffix("").parts]).removesuffix(".__init__")
            out += _module_sizes(module, path, in_api=path.parent.name == "api" and package == "agentjet_server")
    allowed = [line for line in out if line.split(":")[0] not in SIZE_EXCEPTIONS]
    unused = sorted(set(SIZE_EXCEPTIONS) - {line.split(":")[0] for line in out})
    return allowed + [f"{name}: in SIZE_EXCEPTIONS but within its bound now; take it off the list" for name in unused]


def _module_sizes(module: str, path: Path, in_api: bool) -> list[str]:
    """One module's breaches of the size contracts (``module``: its dotted name, for the messages)."""
    text = path.read_text()
    tree = ast.parse(text)
    out = []
    lines = len(text.splitlines())
    if lines > MAX_FILE:
        out.append(f"{module}: {lines} lines, over {MAX_FILE} for a file; split it by job")
    if in_api and lines > MAX_API_MODULE:
        out.append(f"{module}: {lines} lines, over {MAX_API_MODULE} for an api module; split the family")
    classes = {node.name: _span(node) for node in tree.body if isinstance(node, ast.ClassDef)}
    for node in tree.body:  # module functions that take a class's instance count toward that class
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            owner = _annotated_class(node)
            if owner in classes:
                classes[owner] += _span(node)
            params = node.args.posonlyargs + node.args.args
            if params and params[0].annotation is None:
                out.append(f"{module}.{node.name}: its first parameter has no annotation; annotate it")
    for name, size in classes.items():
        if size > MAX_CLASS:
            out.append(
                f"{module}.{name}: {size} lines with the module functions that take it, over {MAX_CLASS}; "
                "cut it into parts of one job each"
            )
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        size = _span(node)
        if size > MAX_FUNCTION:
            out.append(f"{module}.{node.name}: {size} lines, over {MAX_FUNCTION} for a function; cut out its steps")
        if node.name == "create_app" and size > MAX_CREATE_APP:
            out.append(f"{module}.create_app: {size} lines, over {MAX_CREATE_APP}; it only assembles")
        routed = in_api and node.col_offset == 0 and any(a.arg == "request" for a in node.args.args)
        if routed and size > MAX_ROUTE:
            out.append(f"{module}.{node.name}: {size} lines, over {MAX_ROUTE} for a route")
    return out


def engine_probes() -> list[str]:
    """``getattr(engine, ...)``/``hasattr(...engine...)`` outside the engine package."""
    source = SOURCES["agentjet_server"]
    out = []
    for path in sorted(source.rglob("*.py")):
        if path.relative_to(source).parts[0] == "engine":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
            ):
                if node.args and "engine" in ast.unparse(node.args[0]).lower():
                    where = f"{path.relative_to(ROOT)}:{node.lineno}"
                    out.append(f"{where}: {ast.unparse(node)}; declare the capability on engine.base.Engine")
    return out


def public_docstrings() -> list[str]:
    import importlib

    out = []
    for package in SOURCES:
        module = importlib.import_module(package)
        for name in module.__all__:
            if name.startswith("__"):
                continue
            value = getattr(module, name)
            doc = value.__dict__.get("__doc__") if isinstance(value, type) else getattr(value, "__doc__", None)
            if not (doc or "").strip():
                out.append(f"{package}.{name} is public and has no docstring: say what it is for (the API reference)")
    return out


def main() -> int:
    problems = [f"import circle in {p}: {c}" for p in SOURCES for c in import_circles(p)]
    problems += (
        [breach for package in LAYERS for breach in layer_breaches(package)]
        + sizes()
        + engine_probes()
        + public_docstrings()
        + test_mirror()
    )
    for problem in problems:
        print(problem)
    print(f"architecture: {len(problems)} problem(s)" if problems else "architecture: every contract holds")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
