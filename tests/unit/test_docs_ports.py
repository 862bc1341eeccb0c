"""docs/ports.md, the port table, stays in step with the code: every port, address or socket that
ckpt_core's settings read or that `ckpt-engine serve` takes is in the table (with its default), every
setting and option the table names exists, and every ZeroMQ socket name the code binds is listed."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from ckpt_core._settings import ENV_VARS
from ckpt_core.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
PORTS = ROOT / "docs" / "ports.md"
PORT_LIKE = re.compile(r"\bport\b|address|host:port|socket|`uds:", re.I)   # what a setting's meaning says
OURS = re.compile(r"`((?:MASTER|PS|CKPT)_[A-Z0-9_]+)`")                     # our settings' namespaces
OPTION = re.compile(r"`serve (--[a-z][a-z-]*)`")


def _table() -> str:
    rows = [line for line in PORTS.read_text().splitlines() if line.startswith("| ") and not line.startswith("| what")]
    assert len(rows) >= 10, "docs/ports.md lost its table"
    return "\n".join(rows)


def _serve() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def _port_like_options() -> set[str]:
    out = set()
    for action in _serve()._actions:
        for opt in action.option_strings:
            if opt.startswith("--") and re.search(r"port|host|uds|url", opt) and action.help != argparse.SUPPRESS:
                out.add(opt)
    return out


def test_every_port_address_or_socket_setting_is_in_the_table_with_its_default():
    table = _table()
    port_like = {n for n, (_, _, meaning) in ENV_VARS.items() if PORT_LIKE.search(meaning) or n.endswith("_PORT")}
    assert {"MASTER_ADDR", "MASTER_PORT", "PS_P2P_HOST", "CKPT_ENGINE_SERVE_MASTER"} <= port_like, port_like
    missing = {n for n in port_like if f"`{n}`" not in table}
    assert not missing, f"docs/ports.md lacks the settings {sorted(missing)}"
    for name in port_like:
        default = ENV_VARS[name][1]
        row = next(line for line in table.splitlines() if f"`{name}`" in line)
        if default.split(":")[-1].isdigit():   # a port: the table says which
            assert default.split(":")[-1] in row, f"{name}'s default {default} is not in its row"


def test_every_setting_the_table_names_exists():
    named = set(OURS.findall(_table()))
    assert named, "the table names no setting"
    assert named <= set(ENV_VARS), f"docs/ports.md names settings ckpt_core does not read: {sorted(named - set(ENV_VARS))}"


def test_every_port_or_socket_option_of_serve_is_in_the_table_and_every_one_it_names_exists():
    options = _port_like_options()
    assert {"--port", "--metrics-port", "--host", "--uds"} <= options, options
    named = set(OPTION.findall(_table()))
    assert options - named == set(), f"docs/ports.md lacks `serve {sorted(options - named)}`"
    real = {o for a in _serve()._actions for o in a.option_strings}
    assert named <= real, f"docs/ports.md names serve options that do not exist: {sorted(named - real)}"


def test_every_zeromq_socket_the_code_binds_is_listed():
    """The ``ipc://@name-`` prefixes of the f-strings in the packages (the sockets the PS, the workers and
    the clients bind) each appear in the table."""
    prefixes = set()
    for path in ROOT.glob("ckpt_*/**/*.py"):
        prefixes.update(re.findall(r'f"(ipc://@[a-z-]+)\{', path.read_text()))
    assert {"ipc://@ckpt-", "ipc://@checkpoint-engine-", "ipc://@ckpt-sglang-reply-"} <= prefixes, prefixes
    table = _table()
    assert all(p in table for p in prefixes), [p for p in prefixes if p not in table]
