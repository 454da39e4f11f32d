"""Delta weight sync: send a copy of the weights only what changed in them since the last sync.

After a small optimizer step most bf16 weights keep their bits: the fp32 master weight moves by
about the learning rate, while a bf16 value changes only when that move crosses a rounding
boundary (a bf16 step is 2**-8 of the value). One Adam step at lr 1e-6 on SmolLM2-135M changes
0.4% of the elements (1.8% at lr 1e-5), and every decoder layer has some of them
(docs/benchmarks.md, "Delta weight sync").

The sender keeps `SentWeights`: a host copy of every tensor as the receiver holds it, in the
receiver's dtype (that is what must match bit for bit). A new tensor is compared with it as
integers of the same width, so a -0.0 that became 0.0, or a NaN's payload, counts as a change, and
the result is a `TensorDelta`:

- nothing, when every bit is the same;
- the changed elements (flat indices and new values), when they take at most `max_share` of the
  whole tensor's bytes (int32 index + bf16 value = 3x an element: sparse below 1/6 of the elements);
- the whole tensor otherwise, or when the copy has no such tensor (the first sync).

A receiver that holds the previous weights applies the delta in place (`TensorDelta.apply_to`)
and then holds exactly the tensor a full sync would have given it. Receivers that cannot
(vLLM's fused q/k/v and gate/up parameters, repacked for the CPU kernels after loading) take
`changed_groups`: the whole fused groups (decoder layers, `model.embed_tokens`) in which any bit
changed, with the unchanged groups skipped.

Memory: the copy is the synced weights once more, in host memory (270 MB for SmolLM2-135M in
bf16); `--weight_sync full` does without it. A per-tensor hash would take no memory but could only
skip whole tensors, and hashing is slower than comparing (figures in docs/benchmarks.md).
"""

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

# A sparse delta is sent when its bytes are at most this share of the whole tensor's bytes.
SPARSE_MAX_SHARE = 0.5
_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class TensorDelta:
    """The change of one tensor since the last sync: new `values` at flat `indices`, or (indices
    None) the whole new tensor.

    Shapes: sparse, `indices` (K,) int32 (int64 past 2**31 elements) and `values` (K,) in the
    tensor's dtype; whole, `values` has the tensor's shape."""

    name: str
    values: Tensor
    indices: Optional[Tensor] = None

    @property
    def sparse(self) -> bool:
        return self.indices is not None

    @property
    def nbytes(self) -> int:
        """Bytes this delta moves: indices and values, or the whole tensor."""
        index_bytes = 0 if self.indices is None else self.indices.numel() * self.indices.element_size()
        return index_bytes + self.values.numel() * self.values.element_size()

    def apply_to(self, tensor: Tensor) -> None:
        """Writes the change into `tensor` (the previous weights, contiguous) in place."""
        if self.indices is None:
            tensor.copy_(self.values.reshape(tensor.shape))
        else:
            tensor.view(-1)[self.indices.long()] = self.values.to(tensor.dtype)


def changed_indices(new: Tensor, old: Tensor) -> Tensor:
    """Flat positions whose bits differ between two tensors of one shape and dtype, compared as
    integers of the element's width (so -0.0 vs 0.0 and NaN payloads are changes).
    Shape: (N...) each -> (K,) int64."""
    ints = _SAME_WIDTH_INT[new.element_size()]
    return torch.nonzero(new.reshape(-1).view(ints) != old.reshape(-1).view(ints)).flatten()


def encode_delta(name: str, new: Tensor, old: Optional[Tensor], max_share: float = SPARSE_MAX_SHARE
                 ) -> Optional[TensorDelta]:
    """What turns `old` (None: the receiver has nothing) into `new`, bit for bit: None when
    nothing changed, sparse when that is at most `max_share` of the whole tensor's bytes, else the
    whole of `new` (not copied)."""
    if old is None or old.shape != new.shape or old.dtype != new.dtype:
        return TensorDelta(name, new)
    changed = changed_indices(new, old)
    if changed.numel() == 0:
        return None
    index_dtype = torch.int32 if new.numel() < 2**31 else torch.int64
    sparse_bytes = changed.numel() * (torch.empty((), dtype=index_dtype).element_size() + new.element_size())
    if sparse_bytes > max_share * new.numel() * new.element_size():
        return TensorDelta(name, new)
    return TensorDelta(name, new.reshape(-1)[changed], changed.to(index_dtype))


def fused_group(name: str) -> str:
    """The module a weight travels with to an engine that fuses: its decoder layer
    (`model.layers.3.mlp.up_proj.weight` -> `model.layers.3`), or its parent module when the name
    has no layer index (`DeepspeedStrategy.iter_parameter_buckets` groups by the same rule)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return ".".join(parts[:-1])


class SentWeights:
    """The sender's record of the weights a receiver holds: a host copy per name, in `dtype` (the
    receiver's; None keeps each tensor's own). `delta` compares a new tensor with it and records
    the new one; `forget` empties it, so the next sync is a full one (after a failed sync, a
    receiver restarted or changed behind the sender's back: whenever in doubt).

    Args:
        dtype: what the receiver holds; compare in it, since a change that rounds away in the
            receiver's dtype is no change there.
        max_share: a sparse delta's largest share of the whole tensor's bytes (`SPARSE_MAX_SHARE`).
    """

    def __init__(self, dtype: Optional[torch.dtype] = None, max_share: float = SPARSE_MAX_SHARE):
        self.dtype, self.max_share = dtype, max_share
        self.copies: dict[str, Tensor] = {}

    @property
    def nbytes(self) -> int:
        """Host memory the copy takes."""
        return sum(t.numel() * t.element_size() for t in self.copies.values())

    def forget(self) -> None:
        self.copies.clear()

    def delta(self, name: str, tensor: Tensor) -> Optional[TensorDelta]:
        """The change of `name` since it was last recorded (None: none), recorded as the new state.
        `tensor` may live on any device; it is compared on the host in the receiver's dtype."""
        new = tensor.detach().to(device="cpu", dtype=self.dtype or tensor.dtype)
        old = self.copies.get(name)
        delta = encode_delta(name, new, old, self.max_share)
        if delta is None:
            return None
        if delta.sparse:
            delta.apply_to(old)
        else:
            # `new` may be the caller's own tensor (already on the host, in the dtype): keep a copy.
            self.copies[name] = new.clone() if new.data_ptr() == tensor.data_ptr() else new.contiguous()
        return delta

    def changed(self, name: str, tensor: Tensor) -> bool:
        """Whether any bit of `name` changed since it was last recorded, recorded as the new
        state: `delta` without finding where (a compare and a copy, about 3x faster)."""
        new = tensor.detach().to(device="cpu", dtype=self.dtype or tensor.dtype)
        old = self.copies.get(name)
        if old is None or old.shape != new.shape or old.dtype != new.dtype:
            self.copies[name] = new.clone() if new.data_ptr() == tensor.data_ptr() else new.contiguous()
            return True
        ints = _SAME_WIDTH_INT[new.element_size()]
        if torch.equal(new.reshape(-1).view(ints), old.reshape(-1).view(ints)):
            return False
        old.copy_(new)
        return True

    def changed_groups(self, bucket: Iterable[tuple[str, Tensor]]) -> tuple[list[tuple[str, Tensor]], int]:
        """For receivers that load whole fused groups (`fused_group`): the `(name, tensor)` pairs
        of `bucket` in the groups where any bit changed (every tensor of such a group, as given),
        and how many groups were skipped because nothing in them changed."""
        groups: dict[str, list[tuple[str, Tensor]]] = {}
        for name, tensor in bucket:
            groups.setdefault(fused_group(name), []).append((name, tensor))
        send, skipped = [], 0
        for pairs in groups.values():
            # Every tensor is compared (and recorded), not just up to the first change.
            changed = [self.changed(name, tensor) for name, tensor in pairs]
            if any(changed):
                send += pairs
            else:
                skipped += 1
        return send, skipped
