"""The package layout's rules (issue 23), read from the source with `ast` (no process) except (e), one fresh
interpreter:

(a) no import cycle between the modules of tp, kernels, models and bench, counting every import statement, those
    inside functions too; (b) no module imports a private name (leading underscore) of another of these modules, nor
    reads one through a module it imported; (c) no function longer than 80 lines (its `def` line to the end of its
    body, docstring included); (d) no product file cites the team's private REFERENCE.md; (e) importing tp changes
    no global state of other modules; (f) every public function and class that tp, kernels and models export (and
    tp.pipeline, tp.testing) has type hints on its parameters and return, its public methods too.
"""
import ast
import importlib
import inspect
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tp", "kernels", "models", "bench")
MAX_FUNCTION_LINES = 80
PRODUCT = ("tp", "kernels", "models", "bench", "docs", "README.md", "setup.py")
TEXT_SUFFIXES = {".py", ".md", ".txt", ".toml", ".cfg", ".ini", ".json", ".yaml", ".yml", ".rst", ".sh"}
API = ("tp", "tp.pipeline", "tp.testing", "kernels", "models")  # modules whose exports need type hints


def _module_files():
    """{dotted module name: path} of every module of PACKAGES."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


MODULES = _module_files()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _is_package(name):
    return MODULES[name].name == "__init__.py"


def _is_private(name):
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _base(importer, node):
    """The module an ImportFrom names, resolved against `importer` for relative imports."""
    if not node.level:
        return node.module
    package = importer if _is_package(importer) else importer.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _imports(importer):
    """(node, module, name imported from it or None, the local name bound) for every import in `importer`."""
    for node in ast.walk(TREES[importer]):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node, alias.name, None, alias.asname or alias.name.partition(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = _base(importer, node)
            for alias in node.names:
                yield node, base, alias.name, alias.asname or alias.name


def _targets(importer, module, name):
    """Our modules an import statement runs: the module (or `module.name` if that is one) and its packages that
    `importer` is not already inside."""
    full = f"{module}.{name}" if name is not None and f"{module}.{name}" in MODULES else module
    parts, out = full.split("."), []
    for i in range(1, len(parts) + 1):
        target = ".".join(parts[:i])
        if target in MODULES and target != importer and not importer.startswith(target + "."):
            out.append(target)
    return out


def _graph():
    return {m: sorted({t for _, module, name, _ in _imports(m) for t in _targets(m, module, name)})
            for m in MODULES}


def _cycle(graph):
    """One import cycle as a list of modules (first == last), or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in graph[m]:
            if state.get(n) == "open":
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = "done"
        return None

    for m in graph:
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycle():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _private_uses(importer):
    """'importer:line: what' for every private name of another of our modules that `importer` imports or reads."""
    found, bound = [], {}  # local name -> our module it is bound to
    for node, module, name, local in _imports(importer):
        if name is not None and f"{module}.{name}" in MODULES:
            bound[local] = f"{module}.{name}"
        elif name is None and module in MODULES:  # `import a.b` binds a, `import a.b as c` binds a.b
            bound[local] = module.partition(".")[0] if local == module.partition(".")[0] else module
        if module in MODULES and module != importer and name is not None and _is_private(name):
            found.append(f"{importer}:{node.lineno}: from {module} import {name}")
    attributes = [n for n in ast.walk(TREES[importer]) if isinstance(n, ast.Attribute)]
    inner = {id(n.value) for n in attributes}
    for node in attributes:
        if id(node) in inner:
            continue  # (each chain a.b.c is read once, from its outermost attribute)
        chain, root = [], node
        while isinstance(root, ast.Attribute):
            chain.insert(0, root.attr)
            root = root.value
        if not isinstance(root, ast.Name) or root.id not in bound:
            continue
        module = bound[root.id]
        for attr in chain:
            if _is_private(attr) and module != importer:
                found.append(f"{importer}:{node.lineno}: {root.id}.{'.'.join(chain)} (private to {module})")
                break
            if f"{module}.{attr}" not in MODULES:
                break
            module = f"{module}.{attr}"
    return found


def test_no_private_name_crosses_modules():
    found = [use for m in MODULES for use in _private_uses(m)]
    assert not found, "private names used outside their module:\n" + "\n".join(found)


def test_functions_are_short():
    long = [f"{name}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines"
            for name, tree in TREES.items() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"functions longer than {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def _product_files():
    for entry in PRODUCT:
        path = ROOT / entry
        paths = [path] if path.is_file() else sorted(path.rglob("*")) if path.is_dir() else []
        yield from (p for p in paths if p.is_file() and p.suffix in TEXT_SUFFIXES and "__pycache__" not in p.parts)


def test_product_files_do_not_cite_the_private_reference():
    cites = [f"{path.relative_to(ROOT)}:{i}: {line.strip()}" for path in _product_files()
             for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
             if "REFERENCE.md" in line or "REFERENCE §" in line]
    assert not cites, "product files cite REFERENCE.md (users do not have it):\n" + "\n".join(cites)


# ---- (e) importing tp changes no global state ------------------------------------------------------------------

_SNAPSHOT = r'''
import atexit, copy, copyreg, faulthandler, hashlib, importlib, json, logging, os, pickle, random, signal, sys
import threading, types, warnings

for name in THIRD_PARTY:  # what the packages import at module level, so that only their own effects show
    try:
        importlib.import_module(name)
    except Exception:
        pass
import torch

np = sys.modules.get("numpy")
WATCHED = [copy, copyreg, pickle, os, sys, warnings, logging, torch, torch.nn, torch.nn.functional, torch.autograd,
           torch.distributed, torch.Tensor, torch.nn.Module, torch.nn.Parameter, torch.autograd.Function,
           torch.distributed.ProcessGroup]

def name_of(value):
    return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', type(value).__qualname__)}"

def attributes():
    return {(name_of(owner) if isinstance(owner, type) else owner.__name__, k): v
            for owner in WATCHED for k, v in vars(owner).items() if not isinstance(v, types.ModuleType)}

def snapshot():
    return {
        "copy._deepcopy_dispatch": sorted(f"{name_of(k)}: {name_of(v)}" for k, v in copy._deepcopy_dispatch.items()),
        "copyreg.dispatch_table": sorted(name_of(k) for k in copyreg.dispatch_table),
        "torch default dtype": str(torch.get_default_dtype()),
        "torch default device": str(torch.get_default_device()),
        "torch threads": torch.get_num_threads(),
        "torch deterministic": torch.are_deterministic_algorithms_enabled(),
        "torch matmul precision": torch.get_float32_matmul_precision(),
        "torch grad mode": torch.is_grad_enabled(),
        "torch RNG": hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest(),
        "python RNG": hashlib.sha1(repr(random.getstate()).encode()).hexdigest(),
        "numpy RNG": None if np is None else hashlib.sha1(repr(np.random.get_state()).encode()).hexdigest(),
        "os.environ": dict(os.environ),
        "warnings.filters": [repr(f) for f in warnings.filters],
        "sys.meta_path": [name_of(f) for f in sys.meta_path],
        "sys.path_hooks": [name_of(h) for h in sys.path_hooks],
        "sys.path": list(sys.path),
        "hooks": [name_of(sys.excepthook), name_of(threading.excepthook), name_of(sys.displayhook)],
        "recursion limit": sys.getrecursionlimit(),
        "signals": {s.name: name_of(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)},
        "logging": [logging.root.level, [repr(h) for h in logging.root.handlers], logging.root.manager.disable,
                    name_of(logging.getLoggerClass())],
        "atexit callbacks": atexit._ncallbacks(),
        "faulthandler": faulthandler.is_enabled(),
    }

before, original = snapshot(), attributes()
for name in PACKAGES_TO_IMPORT:
    importlib.import_module(name)
after = snapshot()
# attributes of the standard library's and torch's modules and classes replaced or removed (monkey-patching)
after["replaced attributes"] = sorted(".".join(k) for k, v in original.items() if attributes().get(k, None) is not v)
before["replaced attributes"] = []
print(json.dumps({k: [before[k], after[k]] for k in before if before[k] != after[k]}, default=str))
'''


def _third_party_module_imports(packages):
    """Modules outside ours that the packages' modules import at module level (not inside functions)."""
    names = set()
    for module, tree in TREES.items():
        if module.partition(".")[0] not in packages:
            continue
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        lazy = {id(n) for f in functions for n in ast.walk(f)}
        for node in ast.walk(tree):
            if id(node) in lazy:
                continue
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names.add(node.module)
                names.update(f"{node.module}.{a.name}" for a in node.names)
    return sorted(n for n in names if n.partition(".")[0] not in PACKAGES)


def test_importing_tp_changes_no_global_state():
    script = _SNAPSHOT.replace("THIRD_PARTY", repr(_third_party_module_imports(("tp", "kernels"))))
    script = script.replace("PACKAGES_TO_IMPORT", repr(["tp", "kernels"]))
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    changed = json.loads(out.stdout.strip().splitlines()[-1])
    assert not changed, "importing tp changed global state (before, after):\n" + "\n".join(
        f"{k}: {v[0]!r}\n  -> {v[1]!r}" for k, v in changed.items())


# ---- (f) type hints --------------------------------------------------------------------------------------------


def _ours(obj):
    name = obj.__name__ if inspect.ismodule(obj) else getattr(obj, "__module__", None) or ""
    return name.partition(".")[0] in PACKAGES


def _api(module_name, seen=None):
    """(qualified name, object) of every public function and class `module_name` exports (its `__all__`, else its
    own public names), exported submodules included."""
    seen = set() if seen is None else seen
    if module_name in seen:
        return []
    seen.add(module_name)
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n, v in vars(module).items() if not n.startswith("_")
                 and getattr(v, "__module__", None) == module_name]
    out = []
    for name in names:
        obj = getattr(module, name)
        if inspect.ismodule(obj) and _ours(obj):
            out += _api(obj.__name__, seen)
        elif (inspect.isfunction(obj) or inspect.isclass(obj)) and _ours(obj):
            out.append((f"{module_name}.{name}", obj))
    return out


def _missing_hints(fn, *, method):
    """What `fn` lacks: 'return' and the names of unannotated parameters (self/cls of a method excepted)."""
    signature = inspect.signature(fn)
    params = list(signature.parameters.values())[1 if method else 0:]
    missing = [p.name for p in params if p.annotation is inspect.Parameter.empty]
    return missing + (["return"] if signature.return_annotation is inspect.Signature.empty else [])


def _callables(name, obj):
    """(qualified name, function, is a method) to check for a public function or class: a class's __init__ and
    public methods, its own and those it inherits from our classes."""
    if inspect.isfunction(obj):
        return [(name, obj, False)]
    found = {}
    for klass in reversed([k for k in obj.__mro__ if _ours(k)]):  # (a subclass's own definition wins)
        generated = getattr(klass, "_fields", None) is not None or "__dataclass_fields__" in vars(klass)
        for attr, value in vars(klass).items():
            if (attr.startswith("_") and attr not in ("__init__", "__call__")) or (attr == "__init__" and generated):
                continue  # (a NamedTuple's or dataclass's generated __init__ is typed by its fields)
            function = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
            if inspect.isfunction(function) and _ours(function):
                found[attr] = (f"{name}.{attr}", function, not isinstance(value, staticmethod))
    return list(found.values())


@pytest.mark.parametrize("module", API)
def test_public_api_has_type_hints(module):
    missing = [f"{qualname}: {', '.join(lacks)}" for name, obj in _api(module)
               for qualname, fn, method in _callables(name, obj) if (lacks := _missing_hints(fn, method=method))]
    assert not missing, f"{module}'s public API without type hints:\n" + "\n".join(missing)
