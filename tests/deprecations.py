"""The test suite's check that lightrft code makes no deprecated calls: a FutureWarning or
DeprecationWarning raised from lightrft code fails the test (tests/conftest.py wraps every test's
setup, call and teardown in `LightrftDeprecations`). Warnings from other code pass on to pytest
unchanged (pytest.ini ignores them).

Which code a warning comes from: the frame its `stacklevel` points at, unless that frame is call
plumbing (`torch.nn.Module.__call__`, transformers' decorators such as `deprecate_kwarg`), whose
frames are skipped until the code that made the call. transformers warns about a deprecated
argument of `model.forward` with `stacklevel=2`, which points into `Module.__call__`; the call
came from the frame outside it.
"""

import sys
import warnings
from pathlib import Path
from types import FrameType

import lightrft

LIGHTRFT_ROOT = Path(lightrft.__file__).resolve().parent
CHECKED = (DeprecationWarning, FutureWarning)
# Frames that pass a call on rather than make it: a warning pointing at one of them is about its caller.
PLUMBING = (
    "torch/nn/modules/module.py",
    "transformers/utils/deprecation.py",
    "transformers/utils/generic.py",
    "transformers/utils/output_capturing.py",
    "peft/peft_model.py",
    "/functools.py",
    "/contextlib.py",
)


def is_plumbing(filename: str) -> bool:
    return filename.replace("\\", "/").endswith(PLUMBING)


def is_lightrft(filename: str) -> bool:
    try:
        return Path(filename).resolve().is_relative_to(LIGHTRFT_ROOT)
    except (OSError, ValueError):
        return False


def calling_frame(frame: FrameType | None, filename: str, lineno: int) -> FrameType | None:
    """The frame the warning is about: the one at (filename, lineno) on the current stack, then
    outwards past call plumbing. None when the warning's location is not on the stack."""
    while frame is not None and not (frame.f_code.co_filename == filename and frame.f_lineno == lineno):
        frame = frame.f_back
    while frame is not None and is_plumbing(frame.f_code.co_filename):
        frame = frame.f_back
    return frame


class LightrftDeprecations:
    """While active, records in `found` every FutureWarning/DeprecationWarning raised from lightrft
    code (see the module docstring), and passes every other warning on to the warning filters and
    handlers that were in place, when it exits."""

    def __init__(self):
        self.found: list[str] = []
        self._passed_on: list[tuple] = []
        self._catcher = warnings.catch_warnings()

    def __enter__(self) -> "LightrftDeprecations":
        self._catcher.__enter__()
        for category in CHECKED:
            warnings.filterwarnings("always", category=category)
        warnings.showwarning = self._show
        return self

    def __exit__(self, *exc) -> None:
        self._catcher.__exit__(*exc)
        for message, category, filename, lineno, module in self._passed_on:
            warnings.warn_explicit(message, category, filename, lineno, module=module)

    def _show(self, message, category, filename, lineno, file=None, line=None) -> None:
        # Called by `warnings.warn` while the warning's call stack is still live.
        frame = calling_frame(sys._getframe(1), filename, lineno)
        where = frame.f_code.co_filename if frame is not None else filename
        if issubclass(category, CHECKED) and is_lightrft(where):
            at = f"{where}:{frame.f_lineno}" if frame is not None else f"{filename}:{lineno}"
            self.found.append(f"{category.__name__} from lightrft code at {at}: {message}")
            return
        module = frame.f_globals.get("__name__") if frame is not None else None
        self._passed_on.append((message, category, filename, lineno, module))
