"""A slice-plan file that is malformed in any way is a ConfigError naming the file (and the field),
never a raw ValueError/AttributeError: ``read_plan_file`` fuzzed with every field of a real plan
replaced by values of the wrong type or removed, and with the file's text cut, flipped and nested
too deep; ``ckpt-engine plan --slices-plan`` answers such a file with the ConfigError exit code."""

import json
import os
import random

import pytest

from ckpt_core import cli
from ckpt_core.errors import ConfigError
from ckpt_core.planning.slices import SliceKey, SlicePlan, plan_to_json, read_plan_file, split_plan
from support.cli_runner import run_cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TENSORS = {"q.weight": ("BF16", (8, 4), 2), "o.weight": ("BF16", (4, 8), 2), "norm.weight": ("F32", (4,), 4)}
WRONG = [None, "x", "1", 1.5, -1, True, 2 ** 70, [], {}, [[1]], {"a": [0, 0, 1]}]


def _doc() -> dict:
    plan = split_plan(SliceKey("fuzz", "tp=2", "test"), TENSORS, 2, {"q.weight": 0, "o.weight": 1})
    return plan_to_json(plan)


def _paths(node, path=()):
    """Every place in the document: dict keys and list items, depth first."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        yield path + (k,)
        yield from _paths(v, path + (k,))


def _mutated(doc: dict, path: tuple, value, *, delete: bool = False) -> dict:
    out = json.loads(json.dumps(doc))
    node = out
    for k in path[:-1]:
        node = node[k]
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return out


def _cases() -> list[tuple[str, str]]:
    """(label, file text) of every malformed variant."""
    doc, cases = _doc(), []
    for path in _paths(doc):
        where = "/".join(map(str, path))
        cases += [(f"{where}={v!r}", json.dumps(_mutated(doc, path, v))) for v in WRONG]
        if isinstance(path[-1], str):
            cases.append((f"{where} removed", json.dumps(_mutated(doc, path, None, delete=True))))
    text, rng = json.dumps(doc), random.Random(3107)
    cases += [(f"cut at {n}", text[:n]) for n in sorted(rng.sample(range(len(text)), 40))]
    for i in range(40):
        at = rng.randrange(len(text))
        cases.append((f"flip {i} at {at}", text[:at] + rng.choice('{}[]",:0-9ex ') + text[at + 1:]))
    cases += [("deep", "[" * 100_000 + "]" * 100_000), ("empty", ""), ("a list", "[]"), ("null", "null"),
              ("no version", json.dumps({k: v for k, v in doc.items() if k != "version"}))]
    return cases


def test_every_malformed_variant_of_a_plan_file_is_a_config_error_naming_the_file(tmp_path):
    path, seen = tmp_path / "plan.json", {"refused": 0, "read": 0}
    for label, text in _cases():
        path.write_text(text)
        try:
            plan = read_plan_file(path)
        except ConfigError as exc:
            assert str(path) in str(exc), (label, str(exc)[:300])
            seen["refused"] += 1
        except Exception as exc:   # noqa: BLE001 - the promise is that nothing else escapes
            pytest.fail(f"{label}: {type(exc).__name__}: {str(exc)[:300]}")
        else:
            assert isinstance(plan, SlicePlan), label
            seen["read"] += 1
    assert seen["refused"] > 1000, seen   # a few mutations are still a valid plan (e.g. a box read whole)


@pytest.mark.parametrize("path, value, field", [
    (("ranks", 0, "rank"), "x", "ranks[0].rank"),
    (("ranks", 1, "rank"), 1.7, "ranks[1].rank"),
    (("ranks", 1, "needs"), [["q.weight", None]], "ranks[1].needs"),
    (("ranks", 0, "params"), "q.weight", "ranks[0].params"),
    (("ranks", 0, "writes"), 3, "ranks[0].writes"),
    (("ranks",), {"0": {}}, "ranks"),
    (("tensors",), [["q.weight", "BF16"]], "tensors"),
    (("tensors", "q.weight"), ["BF16", [8, 4], "2"], "tensors['q.weight'] itemsize"),
    (("key",), "fuzz", "key"),
    (("key", "model"), 7, "key"),
])
def test_the_error_names_the_file_and_the_field(tmp_path, path, value, field):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_mutated(_doc(), path, value)))
    with pytest.raises(ConfigError) as err:
        read_plan_file(bad)
    assert str(bad) in str(err.value) and field in str(err.value), str(err.value)


def test_ckpt_engine_plan_answers_a_malformed_plan_file_with_the_config_exit_code_and_no_traceback(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_mutated(_doc(), ("ranks", 0, "needs"), ["q.weight"])))
    for args in ((), ("--json",)):
        proc = run_cli(*args, "plan", "--size-gib", "1", "--tensors", "10", "--slices-plan", str(bad),
                       env=dict(os.environ, PYTHONPATH=ROOT))
        out = proc.stdout + proc.stderr
        assert proc.returncode == cli.EXIT_CONFIG, (proc.returncode, out[-2000:])
        assert "Traceback" not in out and "bug in ckpt-engine" not in out, out[-2000:]
        assert str(bad) in proc.stderr and "ranks[0].needs" in proc.stderr, proc.stderr[-2000:]
        if args:
            assert json.loads(proc.stdout)["error"]["type"] == "ConfigError"
