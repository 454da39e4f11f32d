"""Importing a user's Python file by path (reward files, workflow files, tool files)."""

import importlib.util
import sys
import zlib
from pathlib import Path
from types import ModuleType


class PythonFileError(ValueError):
    """A file that cannot be imported: missing, not Python, or raising while it runs."""


def import_python_file(path: Path, prefix: str, kind: str = "file") -> ModuleType:
    """Imports the .py file at `path` under a module name unique to its resolved path
    (`prefix`_<crc32 of the path>, the same in every process) and registers it in `sys.modules`
    (dataclasses and pickling inside the file need that); a second call returns the same module.
    Raises `PythonFileError` naming the file (as `kind`: "reward file", "tool file") and the
    cause."""
    path = Path(path)
    if not path.is_file():
        raise PythonFileError(f"{kind} {path} not found; pass the path of a .py file")
    name = f"{prefix}_{zlib.crc32(str(path.resolve()).encode()):08x}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise PythonFileError(f"{kind} {path} cannot be imported as Python (is it a .py file?)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except SystemExit as err:      # sys.exit() at import would end the run with its code and nothing saved
        sys.modules.pop(name, None)
        raise PythonFileError(f"importing {kind} {path} called sys.exit({err.code!r}); a file lightrft imports must "
                              "not exit the process (raise an exception to refuse, or remove the call)") from None
    except Exception as err:
        sys.modules.pop(name, None)
        raise PythonFileError(f"importing {kind} {path} failed: {type(err).__name__}: {err}") from err
    return module
