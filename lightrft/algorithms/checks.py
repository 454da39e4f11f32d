"""Input checks shared by the public entry points of `lightrft.algorithms`.

Errors name the arguments and their shapes so that a caller sees at once which tensor is off.
"""

from torch import Tensor


def check_same_shape(reference_name: str, reference: Tensor, **others: Tensor | None) -> None:
    """Raises ValueError unless every tensor in `others` (None is skipped) has the shape of
    `reference`, naming both arguments and both shapes."""
    for name, tensor in others.items():
        if tensor is not None and tuple(tensor.shape) != tuple(reference.shape):
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} but {reference_name} has shape "
                f"{tuple(reference.shape)}; they must have the same shape"
            )


def check_ndim(name: str, tensor: Tensor, ndim: int, layout: str) -> None:
    """Raises ValueError unless `tensor` has `ndim` dimensions; `layout` is the expected shape in
    the shape alphabet, e.g. "(B, A)"."""
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must have shape {layout}; got shape {tuple(tensor.shape)}")
