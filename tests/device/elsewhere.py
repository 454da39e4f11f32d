"""Tensors "on another device", for CPU tests of device placement.

On a GPU, an engine's rollout lives on the GPU while experience is assembled in host memory, and
an operation mixing the two fails ("Expected all tensors to be on the same device"). CPU runs
have one device, so such bugs pass every CPU test. `Elsewhere` is a tensor subclass that behaves
like a tensor on a second device: an operation whose tensor arguments mix `Elsewhere` and plain
tensors raises the same error, as CUDA would (0-dim plain tensors may mix, as CPU scalars do with
CUDA tensors; plain index tensors may index it); `.to(...)`/`.cpu()` bring it back as a plain tensor.
"""

import torch
from torch.utils._pytree import tree_flatten, tree_map

# Calls that read the values out (python objects), and the indexing calls CUDA allows with host indices.
READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.numpy, torch.Tensor.__repr__, torch.Tensor.__format__,
         torch.Tensor.__reduce_ex__, torch.Tensor.__deepcopy__}
INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}


def moves_here(func, args, kwargs) -> bool:
    """Whether the call copies the tensor to this machine's device (`.cpu()`, `.to(device)`)."""
    if func is torch.Tensor.cpu:
        return True
    if func is torch.Tensor.to:
        return any(isinstance(a, (torch.device, str)) for a in (*args[1:], kwargs.get("device")))
    return False


class DeviceMixError(RuntimeError):
    pass


class Elsewhere(torch.Tensor):
    @staticmethod
    def wrap(tensor: torch.Tensor) -> "Elsewhere":
        return tensor.as_subclass(Elsewhere)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        elsewhere = [t for t in tensors if isinstance(t, Elsewhere)]
        here = [t for t in tensors if not isinstance(t, Elsewhere) and t.dim() > 0]
        if func in READS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if moves_here(func, args, kwargs):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs).as_subclass(torch.Tensor)     # the data arrived here
        if elsewhere and here and func not in INDEXING:
            raise DeviceMixError(f"Expected all tensors to be on the same device, but found at least two devices "
                                 f"(in {getattr(func, '__name__', func)})")
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        return tree_map(lambda t: t.as_subclass(Elsewhere) if type(t) is torch.Tensor else t, out)


def elsewhere(tensor):
    """`tensor` as if it lived on another device (None stays None)."""
    return None if tensor is None else Elsewhere.wrap(tensor)
