"""`ckpt-engine` fuzzed: random and extreme values (nan, inf, negative, huge, garbage) for every option of
every subcommand. Whatever comes in, the outcome is a documented exit code (2 for a value argparse
refuses, naming the option; 0, 3 or 4 otherwise), never a traceback, a hang or a memory blow-up.

The options are found by walking the parser, so a new option is fuzzed without editing this file, and
a new numeric option must use a bounded converter of ``ckpt_core._cli_args``. Each run is a process of
its own, forked from a helper that holds an address-space limit (RLIMIT_AS: what it had mapped after
importing torch, plus 2 GiB), and is killed after a generous timeout. The seed is printed with every
failure; ``CKPT_FUZZ_SEED`` replays one.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import random
import string
import sys
import time

import pytest
import torch

from ckpt_core import cli
from ckpt_core.checkpoint.safetensors import write_file
from support.forked import Zygote, run_python
from support.procs import pythonpath

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEED = int(os.environ.get("CKPT_FUZZ_SEED") or time.time_ns() % 2**32)
RUN_TIMEOUT_S = 60   # a generous ceiling: every run here takes well under a second of work
EXTRA_AS = 2 << 30   # what a run may map beyond the helper's own address space
_ENV = dict(os.environ, PYTHONPATH=pythonpath(ROOT), CKPT_LOG_LEVEL="WARNING")
_LIMITED = Zygote(sys.executable, f"""
import resource, torch, ckpt_core.cli, ckpt_core._ps, ckpt_core.service
with open("/proc/self/status") as f:
    mapped = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (mapped + {EXTRA_AS}, mapped + {EXTRA_AS}))
""", env=_ENV, cwd=ROOT)

# Every value-taking option that is not a number: what kind of text it takes.
TEXT_OPTIONS = {"--uds", "--host", "--token-file", "--device", "--allow-dir", "--engine-url", "--engine-uds",
                "--model", "--slices-plan", "path"}
# --slices-plan's file reader is tested by its own module (tests/unit/test_slices_plan.py).
NOT_FUZZED = {"--slices-plan"}
# Before the fuzzed option: what makes the rest of each subcommand's command line valid. serve is
# given a device kind that does not exist, so that a run whose options all pass stops with a
# ConfigError (exit 4) right before it would start serving.
BASE = {"serve": ["serve", "--device", "nosuch"], "inspect": ["inspect", "{model}"],
        "plan": ["plan", "--size-gib", "16", "--tensors", "300"], "bench": ["bench"]}
EXTREME = ["nan", "NaN", "inf", "-inf", "-1", "-0", "0", "1e308", "-1e308", "99999999999999999999", "1e15",
           "1000000000000000", "1e-320", "garbage", "", " ", "0x10", "1" * 5000, "١٢", "1e"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fuzz") / "m.safetensors")
    gen = torch.Generator().manual_seed(SEED)
    write_file(path, {"a": torch.randn(64, 8, generator=gen), "b": torch.randn(300, generator=gen)})
    return path


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _options(sub: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in sub._actions if a.nargs != 0 and not isinstance(a, argparse._HelpAction)]


def _name(action: argparse.Action) -> str:
    return action.option_strings[0] if action.option_strings else action.dest


OPTIONS = [(cmd, _name(a)) for cmd, sub in _subparsers().items() for a in _options(sub)]


def _action(cmd: str, option: str) -> argparse.Action:
    return next(a for a in _options(_subparsers()[cmd]) if _name(a) == option)


def _argv(cmd: str, option: str, value: str, model: str) -> list[str]:
    base = [a.format(model=model) for a in BASE[cmd]]
    if option == "path":
        return ["inspect", value]
    tail = ["--help"] if cmd == "bench" else []   # a bench that parses shows the benchmark's flags only
    return [*base, f"{option}={value}", *tail]


def _parses(argv: list[str]) -> bool:
    """Whether argparse accepts ``argv`` (in this process; its complaint is swallowed)."""
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        try:
            cli.build_parser().parse_known_args(argv)
        except SystemExit as exc:
            return exc.code == 0
    return True


def _random_values(rng: random.Random, convert) -> list[str]:
    """Random text: numbers of every magnitude and sign, in and around the option's bounds, and garbage."""
    low = convert.low if convert.low is not None else -1e6
    high = convert.high
    inside = low + (high - low) * rng.random() ** 4
    values = [f"{rng.choice('+- ')}{rng.randint(0, 9)}.{rng.randint(0, 999)}e{rng.randint(-400, 400)}",
              str(rng.randint(-10 ** rng.randint(0, 30), 10 ** rng.randint(0, 30))),
              str(int(inside)) if convert.kind is int else repr(inside),
              str(int(high)) if convert.kind is int else repr(high),   # the bound itself: the largest work
              "".join(rng.choice(string.printable.strip()) for _ in range(rng.randint(1, 12)))]
    return values


def _run(argv: list[str]):
    return run_python(_LIMITED, sys.executable, ["-m", "ckpt_core.cli", *argv], cwd=ROOT, env=_ENV,
                      timeout=RUN_TIMEOUT_S)


def _check(argv: list[str], option: str) -> None:
    proc = _run(argv)
    said = f"seed {SEED} (CKPT_FUZZ_SEED), argv {[a[:60] for a in argv]}: exit {proc.returncode}\n" \
           f"{proc.stderr[-3000:]}"
    assert proc.returncode != -9, f"killed after {RUN_TIMEOUT_S} s (a hang?): {said}"
    assert "Traceback" not in proc.stderr + proc.stdout and "MemoryError" not in proc.stderr, said
    if _parses(argv):
        assert proc.returncode in (cli.EXIT_OK, cli.EXIT_FORMAT, cli.EXIT_CONFIG), said
    else:
        assert proc.returncode == cli.EXIT_USAGE, said
        assert option == "path" or option in proc.stderr or "expected one argument" in proc.stderr, said


def test_every_numeric_option_has_bounds_and_every_other_option_is_known():
    for cmd, option in OPTIONS:
        action = _action(cmd, option)
        convert = action.type
        if getattr(convert, "high", None) is not None:
            assert convert.low is not None, f"{cmd} {option}: a number needs a lower bound too"
        else:
            assert action.choices or option in TEXT_OPTIONS | {"--log-level"}, \
                f"{cmd} {option} takes a value that is neither a bounded number of ckpt_core._cli_args, a choice, " \
                "nor a known text option"


NUMBERS = [(c, o) for c, o in OPTIONS if getattr(_action(c, o).type, "high", None) is not None]


@pytest.mark.parametrize("cmd, option", NUMBERS, ids=[f"{c} {o}" for c, o in NUMBERS])
def test_extreme_values_of_a_number_are_a_usage_error_naming_the_option(cmd, option, model):
    convert = _action(cmd, option).type
    accepted = []
    for value in EXTREME + [repr(convert.high * 10), str(int(convert.high) + 1)]:
        argv = _argv(cmd, option, value, model)
        good = _parses(argv)
        try:
            number = float(value)
            fits = math.isfinite(number) and convert.low <= number <= convert.high
        except ValueError:
            fits = False
        if good:
            accepted.append(value)
            assert fits, f"{cmd} {option}={value[:40]!r} was accepted"
    # end to end, in a process of its own: the kinds of refusal, and what was accepted
    for value in ["nan", "-1", "99999999999999999999", repr(convert.high * 10), "garbage", *accepted[:2]]:
        _check(_argv(cmd, option, value, model), option)


FUZZED = [(c, o) for c, o in OPTIONS if o not in NOT_FUZZED]


@pytest.mark.parametrize("cmd, option", FUZZED, ids=[f"{c} {o}" for c, o in FUZZED])
def test_random_values_end_in_a_documented_exit_code(cmd, option, model):
    rng = random.Random(f"{SEED} {cmd} {option}")
    action = _action(cmd, option)
    if getattr(action.type, "high", None) is not None:
        values = _random_values(rng, action.type)
    elif action.choices:
        values = [rng.choice(list(action.choices)), "".join(rng.choice(string.ascii_letters) for _ in range(6))]
    else:   # text: garbage paths, URLs and names
        values = ["".join(rng.choice(string.printable.strip()) for _ in range(rng.randint(1, 40))),
                  "/nonexistent/" + "x" * rng.randint(1, 300), "http://[::1", "{rank}{", ""]
        if option == "--device":   # "" is the default kind: that serve would start serving
            values = [v for v in values if v and v not in ("cpu", "cuda")]
    for value in values:
        if cmd == "bench" and _parses(_argv(cmd, option, value, model)):
            continue   # it would run the benchmark's --help (torch in a fresh process): the parse is the check
        _check(_argv(cmd, option, value, model), option)


@pytest.mark.parametrize("extreme", ["high", "low"])
def test_every_number_of_a_subcommand_at_its_bound_at_once(extreme, model):
    """The largest (smallest) value of every number together: the most work any command line can ask."""
    for cmd in ("inspect", "plan", "serve"):
        argv = [a.format(model=model) for a in BASE[cmd]]
        for action in _options(_subparsers()[cmd]):
            convert = action.type
            if getattr(convert, "high", None) is None or action.help == argparse.SUPPRESS:
                continue
            bound = convert.high if extreme == "high" else convert.low
            value = int(bound) + (1 if extreme == "low" and convert.low_open else 0) if convert.kind is int \
                else (bound if extreme == "high" or not convert.low_open else bound + 1e-9)
            argv.append(f"{_name(action)}={value}")
        assert _parses(argv), argv
        _check(argv, "")


@pytest.mark.parametrize("argv", [
    ["inspect", "{model}", "--ranks", "99999999999999999999"],   # was a list per rank: killed at 24 GB
    ["plan", "--size-gib", "16", "--tensors", "300", "--slots", "100000000000"],   # was a loop over slots
    ["plan", "--size-gib", "1e308", "--tensors", "300"],          # was an OverflowError's traceback
    ["plan", "--size-gib", "16", "--tensors", "1000000000000000"],   # was a 29-billion-second prediction
    ["inspect", "{model}", "--device-mem-gib", "1e300"],
    ["serve", "--device", "cpu", "--max-bucket-gib", "1e300"],
], ids=lambda a: " ".join(a[:1] + a[-2:]))
def test_the_values_of_issue_36_are_refused_with_exit_2_naming_the_option(argv, model):
    argv = [a.format(model=model) for a in argv]
    proc = _run(argv)
    assert proc.returncode == cli.EXIT_USAGE, (proc.returncode, proc.stderr[-2000:])
    assert argv[-2] in proc.stderr and "must be <=" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_inspect_with_a_million_ranks_makes_no_list_per_rank(model, capsys):
    assert cli.main(["--json", "inspect", model, "--ranks", str(1 << 20)]) == 0
    import json
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["ranks"] == 1 << 20 and plan["buckets"] == 2, plan   # one bucket per tensor's owner
