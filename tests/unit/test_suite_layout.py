"""The suite's own layout: pytest imports test files by their basename (its default import mode;
the test folders are not packages), so two test files of one name in different folders fail the
collection of the whole suite with "import file mismatch"."""

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_files_share_a_name():
    seen: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        if "fakes" not in path.parts:
            seen[path.name].append(str(path.relative_to(TESTS)))
    twice = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not twice, f"test files sharing a name (pytest cannot collect both): {twice}"
