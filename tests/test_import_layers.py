"""Imports run one way, top to bottom, read from the source (no import of the package needed).

FLOORS lists the package's rooms (a top-level module or subpackage of swift_liger) from the bottom up. A module may
import modules of its own room and of rooms on lower floors; rooms sharing a floor do not import each other. Checked
here: no import cycle between modules (an import of ``a.b.c`` also runs ``a.b``'s ``__init__``), no import that
runs up or sideways, and every import of swift_liger placed inside a function says why on its first line
(``# lazy: <reason>``). ``python tests/test_import_layers.py`` prints the numbers.
"""
from __future__ import annotations

import ast
import collections
import os
import subprocess
import sys
from typing import Dict, List, NamedTuple

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "swift_liger")

FLOORS = (
    ("env", "versions"),  # settings read from the environment; the tested dependency versions
    ("ops",),             # the kernels
    ("patching",),        # the toolkit patches go through: patch state, family tables, LoRA glue, checkpoints
    ("cache",),           # RollingKVCache
    ("fusions",),         # one spec + patch per fusion, the registry (loss_head: the loss head package)
    ("config",),          # LigerConfig, built from the registry
    ("report",),          # PatchReport
    ("patcher",),         # apply / revert / call_counts
    ("__init__",),        # the public names, loaded on first use
    ("plot", "testing"),  # run-log plots; tiny local models for tests and demos
    ("integration", "ab", "bench"),   # the ms-swift plugin; A/B runs; benchmarks
    ("cli", "demo"),
)
LAZY_MARK = "# lazy:"


class Import(NamedTuple):
    source: str
    target: str
    line: int
    in_function: bool
    text: str


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def modules() -> Dict[str, str]:
    out = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                out[_module_name(path)] = path
    return out


def _targets(mods: Dict[str, str], source: str, node) -> List[str]:
    package = source if mods[source].endswith("__init__.py") else source.rpartition(".")[0]
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names if a.name.split(".")[0] == "swift_liger"]
        return [n if n in mods else n.rpartition(".")[0] for n in names]
    base = node.module or ""
    if node.level:
        anchor = package
        for _ in range(node.level - 1):
            anchor = anchor.rpartition(".")[0]
        base = anchor + ("." + base if base else "")
    if base.split(".")[0] != "swift_liger":
        return []
    out = []
    for alias in node.names:
        candidate = f"{base}.{alias.name}"
        out.append(candidate if candidate in mods else base)
    return out


def imports() -> List[Import]:
    mods = modules()
    found = []
    for source, path in sorted(mods.items()):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        lines = text.splitlines()

        def walk(node, in_function):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    for target in dict.fromkeys(_targets(mods, source, child)):
                        if target != source:
                            found.append(Import(source, target, child.lineno, in_function, lines[child.lineno - 1]))
                walk(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

        walk(ast.parse(text), False)
    return found


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def floor_of() -> Dict[str, int]:
    return {r: i for i, rooms in enumerate(FLOORS) for r in rooms}


def graph(found: List[Import]) -> Dict[str, set]:
    """Module -> modules whose code runs when it imports them: the target and each package above the target that is
    not a package above the source (those already ran)."""
    g = collections.defaultdict(set)
    for imp in found:
        ancestors_of_source = {imp.source.rsplit(".", k)[0] for k in range(1, imp.source.count(".") + 1)}
        g[imp.source].add(imp.target)
        parts = imp.target.split(".")
        for k in range(2, len(parts)):
            parent = ".".join(parts[:k])
            if parent not in ancestors_of_source and parent != imp.source:
                g[imp.source].add(parent)
    return g


def cycles(g: Dict[str, set]) -> List[List[str]]:
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def wrong_way(found: List[Import]) -> List[Import]:
    floors = floor_of()
    return [imp for imp in found if room(imp.source) != room(imp.target)
            and floors[room(imp.target)] >= floors[room(imp.source)]]


def _explained(imp: Import, lines: List[str]) -> bool:
    """The import's first line, an import line right above it, or a comment line right above that block says why
    (one reason covers a block of imports)."""
    i = imp.line - 1
    while i >= 0:
        if LAZY_MARK in lines[i]:
            return True
        i -= 1
        if i < 0:
            return False
        text = lines[i].strip()
        if text.startswith("#"):
            return LAZY_MARK in text
        if not text.startswith(("from ", "import ")):
            return False
    return False


def unexplained_lazy(found: List[Import]) -> List[Import]:
    mods, bad = modules(), []
    for imp in found:
        if imp.in_function:
            with open(mods[imp.source], encoding="utf-8") as f:
                if not _explained(imp, f.read().splitlines()):
                    bad.append(imp)
    return bad


def test_every_room_has_a_floor():
    rooms = {room(m) for m in modules()}
    assert rooms <= set(floor_of()), f"rooms without a floor in FLOORS: {sorted(rooms - set(floor_of()))}"
    assert len(floor_of()) == sum(len(f) for f in FLOORS), "a room is listed twice"


def test_no_import_cycles():
    assert cycles(graph(imports())) == []


def test_imports_run_down():
    bad = [f"{i.source}:{i.line} imports {i.target}" for i in wrong_way(imports())]
    assert bad == [], "imports that run up or sideways (see FLOORS):\n" + "\n".join(bad)


def test_imports_inside_functions_say_why():
    bad = [f"{i.source}:{i.line}: {i.text.strip()}" for i in unexplained_lazy(imports())]
    assert bad == [], f"imports inside a function without a '{LAZY_MARK} <reason>' comment:\n" + "\n".join(bad)


def private_names() -> List[str]:
    """`from module import _name` across modules: a private name another module reaches into (private modules such
    as ops/_common.py, imported whole, are shared pieces and fine)."""
    mods, bad = modules(), []
    for source, path in sorted(mods.items()):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("swift_liger")):
                for alias in node.names:
                    target = _targets(mods, source, ast.ImportFrom(module=node.module, names=[alias], level=node.level))
                    if alias.name.startswith("_") and not alias.name.startswith("__") and target[0] not in (
                            f"{target[0].rpartition('.')[0]}.{alias.name}",):
                        bad.append(f"{source}:{node.lineno} imports {alias.name} from {target[0]}")
    return bad


def test_no_private_names_across_modules():
    assert private_names() == []


def test_op_module_names_say_what_they_hold():
    """ops/: `<op>_kernel.py` holds Triton kernels, `<op>_op.py` builds an op from other modules' kernels and GEMMs
    (none of its own), `_<piece>.py` is a shared piece; no module takes the name of a function the package exports."""
    folder = os.path.join(PACKAGE, "ops")
    with open(os.path.join(folder, "__init__.py"), encoding="utf-8") as f:
        exported = {a.asname or a.name for n in ast.parse(f.read()).body if isinstance(n, ast.ImportFrom)
                    for a in n.names}
    bad = []
    for name in sorted(os.listdir(folder)):
        stem = name[:-3]
        if not name.endswith(".py") or name == "__init__.py":
            continue
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            jit = "@triton.jit" in f.read()
        if stem in exported:
            bad.append(f"{name}: takes the name of the exported function {stem}")
        elif stem.endswith("_kernel") and not jit:
            bad.append(f"{name}: named _kernel but holds no @triton.jit kernel (name it <op>_op.py)")
        elif stem.endswith("_op") and jit:
            bad.append(f"{name}: named _op but holds Triton kernels (name it <op>_kernel.py)")
        elif not stem.startswith("_") and not stem.endswith(("_kernel", "_op")):
            bad.append(f"{name}: neither <op>_kernel.py, <op>_op.py nor a _shared piece")
    assert bad == []


@pytest.mark.parametrize("module", ["swift_liger", "swift_liger.config", "swift_liger.patching.families",
                                    "swift_liger.integration.arguments", "swift_liger.cli"])
def test_torch_free_modules(module):
    """Flags, config and the CLI's argument parsing load without torch (the registry's specs are torch-free)."""
    code = f"import sys, {module}; assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)"
    env = dict(os.environ, SWIFT_LIGER_DISABLE_HOOK="1")
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=os.path.dirname(PACKAGE))


def summary() -> str:
    found = imports()
    mods = modules()
    lines_per_room = collections.Counter()
    files_per_room = collections.Counter()
    for name, path in mods.items():
        with open(path, encoding="utf-8") as f:
            lines_per_room[room(name)] += sum(1 for _ in f)
        files_per_room[room(name)] += 1
    statements = {(i.source, i.line) for i in found}
    lazy = {(i.source, i.line) for i in found if i.in_function}
    out = [f"modules {len(mods)}, lines {sum(lines_per_room.values())}, internal import statements {len(statements)}, "
           f"inside functions {len(lazy)}",
           f"cycles {len(cycles(graph(found)))}, imports up or sideways {len(wrong_way(found))}, "
           f"unexplained lazy imports {len(unexplained_lazy(found))}",
           "room: files, lines"]
    out += [f"  {r}: {files_per_room[r]}, {lines_per_room[r]}" for r in sorted(lines_per_room)]
    return "\n".join(out)


if __name__ == "__main__":
    print(summary())
