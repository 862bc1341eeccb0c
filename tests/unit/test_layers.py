"""ckpt_core's subpackages form layers: a module imports only from its own subpackage or from layers below.

The order, bottom to top (docs/architecture.md has the one-line purpose of each)::

    errors, then _settings                    foundation, imported by everyone
    ops, devices, planning, engines           leaves: need only the foundation
    checkpoint                                sources and host memory
    wire                                      the PS <-> worker wire and the engine-side loop
    transfer                                  the broadcast update
    p2p                                       the P2P path
    _ps, then __init__                        the facade and the public names
    service, then _cli_plan, then cli         what operators run
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "ckpt_core"  # read as text: no torch needed
LAYERS = [
    {"errors"},
    {"_settings", "_cli_args"},
    {"ops", "devices", "planning", "engines"},
    {"checkpoint"},
    {"wire"},
    {"transfer"},
    {"p2p"},
    {"_ps"},
    {"__init__"},
    {"service"},
    {"_cli_plan"},
    {"cli"},
]
LAYER_OF = {unit: depth for depth, units in enumerate(LAYERS) for unit in units}


def unit_of(module: str) -> str:
    """`ckpt_core.wire.stock` -> `wire`; `ckpt_core.errors` -> `errors`; `ckpt_core` -> `__init__`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path) -> set[str]:
    """Every ckpt_core module `path` imports, at module level or inside functions, resolved to absolute names."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "ckpt_core")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "ckpt_core":
                continue
            if target == "ckpt_core":  # `from ckpt_core import errors` or a public name of the facade
                found.update(f"ckpt_core.{a.name}" for a in node.names)
            else:
                found.add(target)
    return found


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_every_unit_of_ckpt_core_has_a_layer():
    units = {unit_of(module_name(p)) for p in SOURCES}
    assert units - LAYER_OF.keys() == set(), "a new subpackage or root module needs its place in LAYERS"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_a_module_imports_only_its_own_subpackage_or_a_lower_layer(path):
    mine = unit_of(module_name(path))
    upward = []
    for target in imported_modules(path):
        theirs = unit_of(target)
        if theirs == mine:
            continue
        if theirs not in LAYER_OF:  # `from ckpt_core import ParameterServer`: a name of the facade
            theirs = "__init__"
        if LAYER_OF[theirs] >= LAYER_OF[mine]:
            upward.append(target)
    assert upward == [], f"{module_name(path)} (layer {mine}) imports upward or sideways: {sorted(upward)}"


def test_the_leaves_do_not_import_each_other():
    leaves = LAYERS[1]
    for path in SOURCES:
        mine = unit_of(module_name(path))
        if mine in leaves:
            others = {unit_of(t) for t in imported_modules(path)} & (leaves - {mine})
            assert others == set(), f"{module_name(path)} imports {others}"


def test_importing_ckpt_core_imports_no_engine_and_no_optional_extra():
    import subprocess
    import sys
    code = ("import sys, ckpt_core; print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'vllm', 'sglang', 'ckpt_vllm', 'ckpt_sglang', 'ckpt_ascend', 'torch_npu', 'mooncake', 'fastapi'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
