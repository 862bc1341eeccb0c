"""ParameterServer is one object in one file: the flows get an explicit update context, not its fields.

The facade (``ckpt_core/_ps.py``) owns its collectives, catalog, update context and P2P state and
hands them to the broadcast and P2P flows (``transfer/context.py``). These tests keep it so: no
mixin spreads the class over other files, and no module under ``ckpt_core`` other than ``_ps.py``
reads or writes a name of the facade's private attribute set (``ps._updates += 1``,
``ps._stop_signal = ...``) on any object. The rule is by name, whatever the object is called (a
``ps`` argument, ``self.ps``, ``owner``), so a reach-in cannot hide behind a new variable name; the
one exception is ``self`` inside a class that is not part of ParameterServer (``Collectives`` has its
own ``self._closed``).
"""

import ast
import inspect
import textwrap
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ckpt_core"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def ps_classes() -> list[type]:
    from ckpt_core._ps import ParameterServer
    return [c for c in ParameterServer.__mro__ if c is not object]


def ps_private_names() -> set[str]:
    """Every private attribute and method of ParameterServer and its bases: the names it defines,
    and every ``self._x`` its methods read or write."""
    names = set()
    for cls in ps_classes():
        names |= {n for n in vars(cls) if _private(n)}
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
        names |= {a.attr for a in ast.walk(tree) if isinstance(a, ast.Attribute) and _private(a.attr)
                  and isinstance(a.value, ast.Name) and a.value.id == "self"}
    return names


def reach_ins(names: set[str], ps_bases: set[tuple[str, str]], package: Path = PACKAGE) -> list[str]:
    """``path:line: expr`` for each use of ``names`` in ``package`` outside ``_ps.py``, other than
    through ``self`` in a class that is not one of ``ps_bases`` ((module, class) pairs)."""
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent)
        if rel.as_posix() == "ckpt_core/_ps.py":
            continue
        module = ".".join(rel.with_suffix("").parts)

        def walk(node, cls):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.Attribute) and child.attr in names:
                    through_self = isinstance(child.value, ast.Name) and child.value.id == "self"
                    if not through_self or (module, cls) in ps_bases:
                        found.append(f"{rel}:{child.lineno}: {ast.unparse(child)}")
                walk(child, child.name if isinstance(child, ast.ClassDef) else cls)

        walk(ast.parse(path.read_text()), None)
    return found


def test_parameter_server_is_one_class_of_ps_py_without_mixins():
    assert [(c.__module__, c.__qualname__) for c in ps_classes()] == [("ckpt_core._ps", "ParameterServer")]


def test_no_module_reads_or_writes_the_parameter_servers_private_fields():
    bases = {(c.__module__, c.__qualname__) for c in ps_classes()}
    names = ps_private_names()
    assert {"_coll", "_p2p", "_check_open", "_log"} <= names   # the rule sees the facade's fields
    assert reach_ins(names, bases) == []


def test_the_rule_catches_a_reach_in_and_a_mixin(tmp_path):
    """The walk is not vacuous: a function that bumps the facade's counter is reported, and so is a
    mixin's ``self`` (a class the facade inherits from); the facade's own file is not."""
    fake = tmp_path / "ckpt_core"
    (fake / "p2p").mkdir(parents=True)
    (fake / "_ps.py").write_text("class ParameterServer:\n    def f(self, other):\n        other._updates = 0\n")
    (fake / "p2p" / "update.py").write_text("def run(ps):\n    ps._updates += 1\n\n\nclass C:\n"
                                            "    def g(self):\n        return self._updates\n")
    assert reach_ins({"_updates"}, set(), fake) == ["ckpt_core/p2p/update.py:2: ps._updates"]
    assert reach_ins({"_updates"}, {("ckpt_core.p2p.update", "C")}, fake) == [
        "ckpt_core/p2p/update.py:2: ps._updates", "ckpt_core/p2p/update.py:7: self._updates"]


class FakeStore:
    """The rendezvous store's two calls a stop signal makes, recorded."""

    def __init__(self):
        self.values = {}

    def set(self, key, value):
        self.values[key] = value

    def check(self, keys):
        return all(k in self.values for k in keys)


def a_context(store):
    from types import SimpleNamespace
    import logging
    from ckpt_core._settings import load_settings
    from ckpt_core.devices import get_backend
    from ckpt_core.transfer.context import UpdateContext
    return UpdateContext(settings=load_settings(rank=1, world_size=2), backend=get_backend("cpu"), device_index=0,
                         device_key="key-1", device_keys=["key-0", "key-1"], run_id="run", wire="native",
                         coll=SimpleNamespace(store=store), keep_device_buffers=False,
                         log=logging.getLogger("test"), tell=lambda *a: None)


def test_the_context_counts_updates_and_stops_the_armed_update_on_every_rank_once():
    store = FakeStore()
    ctx = a_context(store)
    try:
        assert [ctx.next_update_id(), ctx.next_update_id()] == ["run-0", "run-1"]
        signal = ctx.stop_signal("run-1", None)
        ctx.arm(signal)
        ctx.stop("close() was called on rank 1 during the update")
        assert store.values == {"ckpt/run-1/abort": "rank 1: close() was called on rank 1 during the update"}
        assert ctx.closing == "close() was called on rank 1 during the update"
        ctx.disarm(signal)
        assert signal.store is None   # the ended update lets go of the store
        store.values.clear()
        ctx.stop("again")   # nothing armed: nothing published, a later update stops at its first wait
        assert store.values == {} and ctx.closing == "again"
    finally:
        ctx.close()


def getattr_reach_ins(package: Path = PACKAGE) -> list[str]:
    """``getattr(ps, "_x"...)`` (or ``self.ps``, ``owner.ps``) with a private name, outside ``_ps.py``:
    a reach-in the attribute walk cannot see, and one that silently reads a default when the field
    moves (the service's status once read ``ps._metas`` and ``ps._checkpoints`` so)."""
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent)
        if rel.as_posix() == "ckpt_core/_ps.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in
                    ("getattr", "setattr", "hasattr") and len(node.args) >= 2):
                continue
            obj, attr = node.args[0], node.args[1]
            is_ps = (isinstance(obj, ast.Name) and obj.id == "ps") or (isinstance(obj, ast.Attribute)
                                                                      and obj.attr == "ps")
            if is_ps and isinstance(attr, ast.Constant) and isinstance(attr.value, str) and _private(attr.value):
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_reads_the_parameter_servers_private_fields_by_getattr(tmp_path):
    assert getattr_reach_ins() == []
    fake = tmp_path / "ckpt_core"
    (fake / "service").mkdir(parents=True)
    (fake / "service" / "app.py").write_text("def f(ps):\n    return getattr(ps, '_metas', {})\n")
    assert getattr_reach_ins(fake) == ["ckpt_core/service/app.py:2: getattr(ps, '_metas', {})"]
