"""The package's structural rules (docs/DESIGN.md), checked on its source.

* Layers: each package imports only packages of its own or a lower layer.
* No underscored name (function, class, constant or module) is imported across modules.
* No library function body is longer than 60 lines (docstring aside), except Triton kernels;
  none takes more than 12 positional parameters.
* Every environment variable is read in moekit/config.py.
* Every op is built on the op base (moekit/runtime/op.py): no module of the op layers
  registers a custom op itself, takes a plan uid or writes the cache directly.
* State that outlives a call lives in moekit/runtime/state.py: no other module binds a
  module-level name to an empty container, nor a lowercase name to any new container (tables
  in CAPITALS are constants).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "moekit"

# Lower layers first; a module may import from its own layer or any lower one.
LAYERS = {
    "config": 0,
    "activations": 0,
    "version": 0,
    "runtime": 1,
    "distributed": 1,
    "tuning": 2,
    "kernels": 3,
    "reference": 4,
    "ops": 5,
    "nn": 6,
    "fusion": 7,
    "integrations": 7,
}
MAX_FUNCTION_LINES = 60
MAX_POSITIONAL = 12


def _modules():
    return sorted(p for p in PACKAGE.rglob("*.py"))


def _layer_of(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "moekit" or len(parts) < 2:
        return None
    return LAYERS.get(parts[1])


def _name_of(path: pathlib.Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(tree: ast.AST):
    """(module, imported name or None) for every moekit import."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("moekit"):
            for alias in node.names:
                yield node.module, alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("moekit"):
                    yield alias.name, None


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_layers_and_no_private_imports(path):
    me = _name_of(path)
    tree = ast.parse(path.read_text())
    my_layer = _layer_of(me)
    for module, name in _imports(tree):
        target = f"{module}.{name}" if name else module
        parts = module.split(".") + ([name] if name else [])
        assert not any(p.startswith("_") for p in parts), f"{me} imports private {target}"
        their = _layer_of(module)
        if my_layer is not None and their is not None:
            assert their <= my_layer, f"{me} (layer {my_layer}) imports {module} ({their})"


def _is_triton_kernel(fn: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in fn.decorator_list)


def _body_lines(fn: ast.FunctionDef) -> int:
    lines = fn.end_lineno - fn.lineno + 1
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        doc = body[0]
        lines -= doc.end_lineno - doc.lineno + 1
    return lines


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_long_functions(path):
    tree = ast.parse(path.read_text())
    long = [
        f"{fn.name} ({_body_lines(fn)} lines)"
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
        and not _is_triton_kernel(fn)
        and _body_lines(fn) > MAX_FUNCTION_LINES
    ]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_long_parameter_lists(path):
    many = []
    for fn in ast.walk(ast.parse(path.read_text())):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) and not _is_triton_kernel(fn):
            args = [*fn.args.posonlyargs, *fn.args.args]
            n = len(args) - (bool(args) and args[0].arg in ("self", "cls", "ctx"))
            if n > MAX_POSITIONAL:
                many.append(f"{fn.name} ({n})")
    assert not many, f"more than {MAX_POSITIONAL} positional parameters (group them): {many}"


_CONTAINERS = ("dict", "list", "set", "OrderedDict", "defaultdict", "WeakValueDictionary",
               "WeakKeyDictionary", "count")  # fmt: skip


def _empty_container(value: ast.AST) -> bool:
    if isinstance(value, ast.Dict | ast.List | ast.Set):
        return not (value.keys if isinstance(value, ast.Dict) else value.elts)
    return isinstance(value, ast.Call) and not value.args and _new_container(value)


def _new_container(value: ast.AST) -> bool:
    if isinstance(value, ast.Dict | ast.List | ast.Set | ast.DictComp | ast.ListComp):
        return True
    if isinstance(value, ast.Call):
        f = value.func
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
        return name in _CONTAINERS
    return False


def test_state_lives_in_one_place():
    stores = []
    for path in _modules():
        if path.relative_to(PACKAGE).as_posix() == "runtime/state.py":
            continue
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.Assign | ast.AnnAssign) or node.value is None:
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name) and t.id != "__all__"]
            lower = any(not n.isupper() for n in names)
            if names and (_empty_container(node.value) or (lower and _new_container(node.value))):
                stores.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {names}")
    assert not stores, f"module-level state outside runtime/state.py: {stores}"


def test_environment_read_only_in_config():
    readers = []
    for path in _modules():
        if path.name == "config.py" and path.parent == PACKAGE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
                src = ast.unparse(node)
                if src.startswith("os."):
                    readers.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    # The distributed package sets the no-multicast variables and reads torchrun's (RANK ...),
    # which are not moekit knobs: listed here, everything else goes through config.py.
    allowed = {"distributed/env.py"}
    assert {r.split(":")[0] for r in readers} <= allowed, readers


# What only the op base does for the op layers: register custom ops (kernel_op), hand out plan
# uids and cache plans (planned).
_BASE_ONLY = ("torch.library.custom_op", "STATE.uids", "cached")
_OP_LAYERS = ("ops/", "nn/", "fusion/", "integrations/")


def test_ops_are_built_on_the_op_base():
    found = []
    for path in _modules():
        rel = path.relative_to(PACKAGE).as_posix()
        if not rel.startswith(_OP_LAYERS):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute | ast.Name) and ast.unparse(node) in _BASE_ONLY:
                found.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
    # the all-reduce's launch plans hold symmetric buffers of one pool generation, not a
    # validated configuration: cached in the one cache under the pool's generation
    allowed = {"ops/allreduce.py:cached"}
    assert {f"{f.split(':')[0]}:{f.split()[-1]}" for f in found} <= allowed, found
