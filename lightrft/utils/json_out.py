"""JSON that every parser reads: Python's `json.dumps` writes a NaN or an infinity as the bare
words `NaN` and `Infinity`, which are not JSON (strict parsers, `jq` and most HTTP clients refuse
the whole document). Everything lightrft prints or serves as JSON goes through `dumps`, which
writes a non-finite float as null."""

import json
import math
from typing import Any


def finite(value: Any) -> Any:
    """`value` with every non-finite float (in dicts, lists and tuples, at any depth) replaced by
    None. Other values are returned as they are."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value


def dumps(value: Any, **kwargs) -> str:
    """`json.dumps` of `finite(value)`, refusing (ValueError) any non-finite number left."""
    return json.dumps(finite(value), allow_nan=False, **kwargs)
