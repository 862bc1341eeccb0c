"""ckpt_core's subpackages form layers: a module imports only from its own subpackage or from layers below.

The order, bottom to top (docs/architecture.md has the one-line purpose of each)::

    errors, then _settings                    foundation, imported by everyone
    ops                                       logs, GC pause, metrics, progress: need only the foundation
    devices, planning, engines                leaves: need only ops and the foundation, never each other
    checkpoint                                sources and host memory
    wire                                      the PS <-> worker wire and the engine-side loop
    transfer                                  the broadcast update
    p2p                                       the P2P path
    delta                                     delta updates (encoding, versions, the engine-side apply)
    _ps, then __init__                        the facade and the public names
    service and client, then _cli_plan, cli   what operators run

And the core names no engine (DESIGN, STYLE 16): no module under ckpt_core imports an engine package,
at module level or inside a function, and none holds an engine's name as a value code could branch on
or import by. The rule for strings: a string constant that *is* an engine's name or a dotted path into
an engine package (``"sglang"``, ``"ckpt_vllm.client"``, ``"vllm:..."``) is refused anywhere but in a
docstring; prose that mentions an engine (log and error messages, field descriptions) is free text and
allowed. The one allowed value is ``registry.DEFAULT_ENGINE`` (a request that names no engine gets the
reference's, resolved by name like any other).
"""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "ckpt_core"  # read as text: no torch needed
LAYERS = [
    {"errors"},
    {"_settings", "_cli_args"},
    {"ops"},
    {"devices", "planning", "engines"},
    {"checkpoint"},
    {"wire"},
    {"transfer"},
    {"p2p"},
    {"delta"},
    {"_ps"},
    {"__init__"},
    {"service", "client"},
    {"_cli_plan"},
    {"cli"},
]
LEAVES = {"devices", "planning", "engines"}
LAYER_OF = {unit: depth for depth, units in enumerate(LAYERS) for unit in units}
# Engine packages (ours and the engines' own) and the frameworks they bind to.
ENGINES = ("ckpt_vllm", "ckpt_sglang", "ckpt_verl", "vllm", "sglang", "verl", "vllm_ascend", "trl")
ENGINE_VALUE = re.compile(rf"(?:{'|'.join(ENGINES)})(?:[.:][\w.:]*)?", re.IGNORECASE)
ALLOWED_VALUES = {("engines/registry.py", "DEFAULT_ENGINE")}   # (module, the name assigned)


def unit_of(module: str) -> str:
    """`ckpt_core.wire.stock` -> `wire`; `ckpt_core.errors` -> `errors`; `ckpt_core` -> `__init__`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path, package: Path = PACKAGE) -> str:
    rel = path.relative_to(package.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _absolute_imports(path: Path, package: Path = PACKAGE) -> list[tuple[ast.AST, str, list[str]]]:
    """Every import of ``path``, at module level or inside functions: (node, absolute module, names)."""
    here = module_name(path, package)
    pkg = here if path.name == "__init__.py" else here.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((node, target, [a.name for a in node.names]))
    return found


def imported_modules(path: Path, package: Path = PACKAGE) -> set[str]:
    """Every ckpt_core module `path` imports, at module level or inside functions, resolved to absolute names."""
    found = set()
    for _, target, names in _absolute_imports(path, package):
        if target.split(".")[0] != "ckpt_core":
            continue
        if target == "ckpt_core" and names:  # `from ckpt_core import errors` or a public name of the facade
            found.update(f"ckpt_core.{n}" for n in names)
        else:
            found.add(target)
    return found


def engine_imports(path: Path, package: Path = PACKAGE) -> list[str]:
    """``line: module`` of every import of an engine package in ``path``, lazy ones included."""
    return [f"{node.lineno}: {target}" for node, target, _ in _absolute_imports(path, package)
            if target.split(".")[0].lower() in ENGINES]


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                ids.add(id(first.value))
    return ids


def engine_values(path: Path, package: Path = PACKAGE) -> list[str]:
    """``line: 'value'`` of every string constant of ``path`` outside docstrings that is an engine's name
    or a dotted path into an engine package (a value code could compare, key a table by or import)."""
    tree = ast.parse(path.read_text())
    skip = _docstrings(tree)
    rel = str(path.relative_to(package))
    for node in tree.body:   # the allowed module-level values
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Constant):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and (rel, t.id) in ALLOWED_VALUES for t in targets):
                skip.add(id(node.value))
    found = [node for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
             and id(node) not in skip and ENGINE_VALUE.fullmatch(node.value.strip())]
    return [f"{node.lineno}: {node.value!r}" for node in sorted(found, key=lambda n: (n.lineno, n.col_offset))]


SOURCES = sorted(PACKAGE.rglob("*.py"))
IDS = {"ids": lambda p: str(p.relative_to(PACKAGE))}


def test_every_unit_of_ckpt_core_has_a_layer():
    units = {unit_of(module_name(p)) for p in SOURCES}
    assert units - LAYER_OF.keys() == set(), "a new subpackage or root module needs its place in LAYERS"


def upward_imports(path: Path, package: Path = PACKAGE) -> list[str]:
    mine = unit_of(module_name(path, package))
    upward = []
    for target in imported_modules(path, package):
        theirs = unit_of(target)
        if theirs == mine:
            continue
        if theirs not in LAYER_OF:  # `from ckpt_core import ParameterServer`: a name of the facade
            theirs = "__init__"
        if LAYER_OF[theirs] >= LAYER_OF[mine]:
            upward.append(target)
    return sorted(upward)


@pytest.mark.parametrize("path", SOURCES, **IDS)
def test_a_module_imports_only_its_own_subpackage_or_a_lower_layer(path):
    assert upward_imports(path) == [], f"{module_name(path)} imports upward or sideways"


def leaf_crossings(sources: list[Path], package: Path = PACKAGE) -> list[str]:
    crossings = []
    for path in sources:
        mine = unit_of(module_name(path, package))
        if mine in LEAVES:
            others = {unit_of(t) for t in imported_modules(path, package)} & (LEAVES - {mine})
            crossings += [f"{module_name(path, package)} imports {sorted(others)}"] if others else []
    return crossings


def test_the_leaves_do_not_import_each_other():
    assert LEAVES == LAYERS[3], "LEAVES names the layer of the leaves"
    assert leaf_crossings(SOURCES) == []


@pytest.mark.parametrize("path", SOURCES, **IDS)
def test_no_module_of_the_core_imports_an_engine_not_even_lazily(path):
    assert engine_imports(path) == [], f"{module_name(path)}: find engines by name (ckpt_core.engines.registry)"


@pytest.mark.parametrize("path", SOURCES, **IDS)
def test_no_module_of_the_core_holds_an_engine_name_outside_prose(path):
    assert engine_values(path) == [], (f"{module_name(path)}: an engine's name as a value (a branch, a table key, "
                                       "an import path); engines own what differs between them (EngineKind)")


def test_the_checks_catch_what_they_guard(tmp_path):
    """Each check above finds its violation in a small tree written here (they would pass vacuously
    if they read nothing)."""
    pkg = tmp_path / "ckpt_core"
    for sub in ("service", "planning", "engines"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "service" / "_update.py").write_text(
        '"""Posts to ``engine="sglang"`` (a docstring may name it)."""\n'
        "import logging\n\n"
        "def client(engine):\n"
        '    """Lazily, as the old code did."""\n'
        "    from ckpt_sglang import SglangClient\n"
        "    import vllm.config\n"
        '    if engine == "sglang":\n'
        '        logging.warning("sglang needs the stock wire")   # prose: allowed\n'
        '    return {"vllm": ("/collective_rpc",)}, "ckpt_vllm.client:VllmClient"\n')
    (pkg / "planning" / "a.py").write_text("from ckpt_core.engines import registry\n")
    (pkg / "engines" / "registry.py").write_text('DEFAULT_ENGINE = "vllm"\nOTHER = "sglang"\n')
    update = pkg / "service" / "_update.py"
    assert engine_imports(update, pkg) == ["6: ckpt_sglang", "7: vllm.config"]
    assert engine_values(update, pkg) == ["8: 'sglang'", "10: 'vllm'", "10: 'ckpt_vllm.client:VllmClient'"]
    assert engine_values(pkg / "engines" / "registry.py", pkg) == ["2: 'sglang'"]
    assert leaf_crossings(sorted(pkg.rglob("*.py")), pkg) == ["ckpt_core.planning.a imports ['engines']"]
    assert upward_imports(pkg / "planning" / "a.py", pkg) == ["ckpt_core.engines"]


def test_importing_ckpt_core_imports_no_engine_and_no_optional_extra():
    code = ("import sys, ckpt_core; from ckpt_core import *; print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'vllm', 'sglang', 'ckpt_vllm', 'ckpt_sglang', 'ckpt_ascend', 'torch_npu', 'mooncake', 'fastapi', 'verl', "
            "'ckpt_verl', 'ray', 'trl'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_importing_every_module_of_ckpt_core_imports_no_engine():
    """The service and the CLI included (they need the `server` extra: imported here, not checked as
    extras); the engines are found by name and imported only when a request names one."""
    code = ("import importlib, pkgutil, sys, ckpt_core\n"
            "names = [m.name for m in pkgutil.walk_packages(ckpt_core.__path__, 'ckpt_core.')]\n"
            "for n in names: importlib.import_module(n)\n"
            "from ckpt_core.engines.registry import available_engines; available_engines()\n"
            "from ckpt_core.service._models import UpdateRequest; UpdateRequest.model_json_schema()\n"
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(ENGINES)!r}), flush=True)\n"
            "print(len(names))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    engines, count = out.stdout.strip().splitlines()[-2:]
    assert int(count) >= len(SOURCES) - 1 and engines == "[]", out.stdout


ADAPTERS = [PACKAGE.parent / name for name in ("ckpt_vllm", "ckpt_sglang", "ckpt_verl", "ckpt_ascend")]


def private_core_imports(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    """``line: module`` of every import of a private ckpt_core module (a ``_``-prefixed part) in ``path``."""
    package = root / path.relative_to(root).parts[0]
    return [f"{node.lineno}: {target}" for node, target, _ in _absolute_imports(path, package)
            if target.split(".")[0] == "ckpt_core" and any(p.startswith("_") for p in target.split(".")[1:])]


@pytest.mark.parametrize("path", sorted(p for d in ADAPTERS for p in d.rglob("*.py")),
                         ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_engine_packages_use_the_core_through_its_public_modules_only(path):
    """No arrow back up: an adapter needing a private piece of the core means that piece is public
    (ckpt_core.engines.managed was ckpt_core.service._managed)."""
    assert private_core_imports(path) == []


def test_the_private_import_check_catches_one(tmp_path):
    (tmp_path / "ckpt_vllm").mkdir()
    mod = tmp_path / "ckpt_vllm" / "transfer_engine.py"
    mod.write_text("def start():\n    from ckpt_core.service._managed import start_from_env\n")
    assert private_core_imports(mod, tmp_path) == ["2: ckpt_core.service._managed"]
