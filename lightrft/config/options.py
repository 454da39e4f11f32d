"""Options as dataclass fields, and the command-line flags generated from them.

A config section is a frozen dataclass whose fields are declared with `option(...)`: the default,
the help text and how the flag parses live on the field, so the flag, the YAML key and the Python
attribute are one name with one default. `add_section_flags` turns a section into an argparse
group; `section_from_namespace` builds the section back from parsed flags.
"""

import argparse
import dataclasses
import types
import typing
from dataclasses import MISSING, field
from typing import Any, Callable, Iterable, Optional, Union

from lightrft.utils.secrets import KINDS as SECRET_KINDS


def option(default: Any = MISSING, help: str = "", *, choices: Optional[Union[Iterable, Callable[[], Iterable]]] = None,
           nargs: Optional[Union[int, str]] = None, metavar=None, const: Any = None, required: bool = False,
           flag: bool = True, secret: Optional[str] = None, at_least=None, above=None, at_most=None, below=None,
           off=None) -> Any:
    """A config field with its flag: `choices` may be a callable (a registry read when the parser
    is built, so variants registered before parsing are selectable); `required` makes the flag
    mandatory on the command line (the field then defaults to None); `flag=False` keeps a field
    off the command line (a value derived from other options); `secret` marks a value that must
    never be written as given ("key": all of it, "urls": credentials of URLs in it), redacted by
    `lightrft.utils.secrets` wherever options become text or files. `at_least`/`above` and
    `at_most`/`below` bound a number (inclusive/exclusive); `off` is a value allowed outside them
    that switches the option off (-1 for "never"); None always passes (`check_bounds`)."""
    if secret is not None and secret not in SECRET_KINDS:
        raise ValueError(f"option secret kind must be 'key' or 'urls', got {secret!r}")
    metadata = {"help": help, "choices": choices, "nargs": nargs, "metavar": metavar, "const": const,
                "required": required, "flag": flag, "secret": secret,
                "bounds": {k: v for k, v in (("at_least", at_least), ("above", above), ("at_most", at_most),
                                             ("below", below)) if v is not None}, "off": off}
    return field(default=None if required and default is MISSING else default, metadata=metadata)


def _base_type(annotation) -> tuple[Any, bool]:
    """(the element type, whether None is allowed) of a field annotation."""
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _base_type(args[0])[0], True
    return annotation, False


def _element(annotation):
    """The element type of tuple[...] / list[...], else None."""
    if typing.get_origin(annotation) in (tuple, list):
        args = [a for a in typing.get_args(annotation) if a is not Ellipsis]
        return args[0] if args else str
    return None


def flag_fields(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.metadata.get("flag", False)]


def add_section_flags(parser: argparse.ArgumentParser, cls, title: str, description: str = "",
                      group: Optional[argparse._ArgumentGroup] = None) -> argparse._ArgumentGroup:
    """Adds one `--<field>` per flag field of `cls` to a group titled `title`."""
    group = group or parser.add_argument_group(title, description or None)
    hints = typing.get_type_hints(cls)
    for f in flag_fields(cls):
        meta = f.metadata
        base, _ = _base_type(hints[f.name])
        kwargs: dict[str, Any] = {"help": meta["help"] + bounds_note(f), "dest": f.name}
        default = f.default if f.default is not MISSING else None
        if base is bool:
            kwargs.update(action="store_true", default=bool(default))
        else:
            element = _element(base)
            kwargs["type"] = element if element is not None else base
            kwargs["default"] = default
            if element is not None:
                kwargs["nargs"] = meta["nargs"] or "*"
            elif meta["nargs"] is not None:
                kwargs["nargs"] = meta["nargs"]
            if meta["const"] is not None:
                kwargs["const"] = meta["const"]
            choices = meta["choices"]
            if choices is not None:
                kwargs["choices"] = list(choices() if callable(choices) else choices)
            if meta["metavar"] is not None:
                kwargs["metavar"] = meta["metavar"]
            if meta["required"]:
                kwargs["required"] = True
        group.add_argument(f"--{f.name}", **kwargs)
    return group


def section_from_namespace(cls, namespace: argparse.Namespace, **derived):
    """`cls` with every flag field read from `namespace` (lists become tuples, so the section
    stays immutable) and the non-flag fields from `derived`."""
    values = {}
    for f in flag_fields(cls):
        if hasattr(namespace, f.name):
            value = getattr(namespace, f.name)
            values[f.name] = tuple(value) if isinstance(value, list) else value
    values.update(derived)
    return cls(**values)


_BOUND_WORDS = {"at_least": ">=", "above": ">", "at_most": "<=", "below": "<"}


def bounds_note(f: dataclasses.Field) -> str:
    """The bounds of `f` for its --help line, e.g. " [>= 1]" or " [-1 (off) or >= 1]"; "" if none."""
    bounds, off = f.metadata.get("bounds") or {}, f.metadata.get("off")
    if not bounds:
        return ""
    wanted = " and ".join(f"{_BOUND_WORDS[k]} {v}" for k, v in bounds.items())
    return f" [{off} (off) or {wanted}]" if off is not None else f" [{wanted}]"


def bound_problem(f: dataclasses.Field, value) -> Optional[str]:
    """Why `value` is outside the bounds `option` declared for field `f`, or None."""
    bounds, off = f.metadata.get("bounds") or {}, f.metadata.get("off")
    if value is None or not bounds or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if off is not None and value == off:
        return None
    tests = {"at_least": lambda bound: value >= bound, "above": lambda bound: value > bound,
             "at_most": lambda bound: value <= bound, "below": lambda bound: value < bound}
    if all(tests[kind](bound) for kind, bound in bounds.items()):
        return None
    wanted = " and ".join(f"{_BOUND_WORDS[k]} {v}" for k, v in bounds.items())
    if off is not None:
        wanted = f"{off} (off) or {wanted}"
    help_text = f.metadata.get("help", "")
    return f"--{f.name} must be {wanted}, got {value}" + (f" ({help_text})" if help_text else "")
