"""Optimizer parameter groups: weight decay on matrices, none on biases and norm weights."""

from torch import nn

NO_DECAY_NAME_PARTS = ("bias", "norm")


def is_no_decay(name: str, param: nn.Parameter) -> bool:
    """Biases and normalisation weights are not decayed (decaying a gain towards 0 shrinks the
    activations, which AdamW's decoupled decay is not meant to do; Loshchilov & Hutter 2019 decay
    the weights of linear maps). One-dimensional tensors are treated as such; under ZeRO-3 the
    original shape is `param.ds_shape`, since the local tensor is a flat shard."""
    shape = getattr(param, "ds_shape", param.shape)
    return len(shape) < 2 or any(part in name.lower() for part in NO_DECAY_NAME_PARTS)


def weight_decay_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """Two optimizer groups over the trainable parameters of `module`: `weight_decay` for the
    rest, 0 for biases and norm weights. Empty groups are left out."""
    decay, no_decay = [], []
    for name, param in module.named_parameters():
        if param.requires_grad:
            (no_decay if is_no_decay(name, param) else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]
