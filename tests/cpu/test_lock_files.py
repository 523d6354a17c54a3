"""The lock files every install uses (scripts/install.sh) agree with what they are made from
(scripts/lock.sh): each top-level pin of .ci/constraints.txt at its version, every dependency of
pyproject.toml present, each entry pinned with hashes, and torch in neither (install.sh installs
the build that fits the machine first)."""

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENTRY = re.compile(r"^([A-Za-z0-9_.-]+)==([^\s\\]+) \\$", re.M)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked(path: Path) -> dict[str, str]:
    text = path.read_text()
    entries = {canonical(name): version for name, version in ENTRY.findall(text)}
    # Every entry is followed by its hashes.
    assert len(re.findall(r"==[^\s\\]+ \\\n    --hash=sha256:[0-9a-f]{64}", text)) == len(entries)
    return entries


@pytest.mark.parametrize("lock, extras", [("requirements.lock", ("redis",)),
                                          ("requirements-dev.lock", ("redis", "test"))])
def test_each_lock_pins_every_dependency_at_the_constrained_version(lock, extras):
    entries = locked(ROOT / lock)
    assert "torch" not in entries
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", (ROOT / ".ci/constraints.txt").read_text(), re.M))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"]) + [d for e in extras for d in project["optional-dependencies"][e]]
    for requirement in wanted:
        name = canonical(re.split(r"[<>=\[; ]", requirement, maxsplit=1)[0])
        if name == "torch":
            continue
        assert name in entries, f"{lock} lacks {name}: run scripts/lock.sh"
        if name in {canonical(p) for p in pins}:
            pinned = next(v for p, v in pins.items() if canonical(p) == name)
            assert entries[name] == pinned, f"{lock} has {name}=={entries[name]}, constraints {pinned}"
