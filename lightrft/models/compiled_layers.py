"""Decoder layers under torch.compile around lightrft's packed attention (`--torch_compile`).

Each decoder layer's `forward` is compiled, not the module: the module's hooks (DeepSpeed ZeRO-3
gathers parameters in forward pre-hooks), Hugging Face gradient checkpointing (which wraps the
layer's `__call__`), parameter names and state dicts stay as they are. The compiled forward hands
the attention its keywords in one opaque `attention.HeldKeywords`, which makes lightrft's attention
(`attention.packed_attention`) run outside the graphs: a layer compiles into graphs before the
attention call (norms, projections, rotary embedding) and after it (output projection, residuals,
MLP), a few in all as dynamo also splits the layer where it calls its attention module (the
layers of a kind share them), and the attention runs eagerly, its varlen kernels,
shared-prompt layouts and sequence-parallel exchange untouched. Every dimension is dynamic and the
host-side lengths stay in the opaque object, so micro-batches of other lengths and sequence counts
reuse the graphs.

`CompiledLayers.graphs` counts the graphs compiled (each is logged). Dynamo keeps at most
`RECOMPILE_LIMIT` compiled versions of each piece of layer code (train and eval mode, with and
without gradients, sliding and full layers, padded and packed inputs each need their own); past the
limit a new kind of input runs that piece eagerly, with dynamo's warning, and the count stops
growing. Mixture-of-experts layers are split further where their expert dispatch depends on the
routing (data-dependent sizes).
"""

import logging

import torch
from torch import nn
from transformers.cache_utils import Cache

from lightrft.models.attention import (HELD_KEYWORD, PACKING_KEYWORDS, VARLEN_ATTENTION, VARLEN_SDPA_LEGACY,
                                       HeldKeywords)

logger = logging.getLogger(__name__)

COMPILE_BACKENDS = ("inductor", "aot_eager")
# Compiled versions dynamo keeps per piece of layer code (its default is 8), set around the compiled
# calls only. A run needs a handful per model: with and without gradients x packed and padded x
# layer kinds (sliding or full, dense or MoE), and the actor, reference and critic each their own.
RECOMPILE_LIMIT = 32


def decoder_layers(model: nn.Module, flag: str = "--pretrain") -> list[nn.Module]:
    """The decoder layers of a Hugging Face model (a peft model's base model's): the modules of the
    classes its `_no_split_modules` names, outside a vision-language model's vision tower. Raises
    naming `--torch_compile` and `flag` when there are none."""
    from lightrft.models.families import family_of

    names = set(getattr(model, "_no_split_modules", None) or ())
    vision = tuple(prefix + "." for prefix in family_of(model).vision_modules(model))
    layers = [module for name, module in model.named_modules()
              if type(module).__name__ in names and not (vision and _under(name, vision))]
    if not layers:
        raise ValueError(f"--torch_compile: {flag} is a {type(model).__name__}, whose decoder layers were not found "
                         f"(none of its modules is of a class its _no_split_modules names: {sorted(names)}); "
                         "drop --torch_compile for this model")
    return layers


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    """Whether module `name` (possibly under a peft wrapper's `base_model.model.`) is inside one of `prefixes`."""
    return any(name.startswith(prefix) or f".{prefix}" in f".{name}" for prefix in prefixes)


class CompiledLayers:
    """Every decoder layer of `model` compiled with torch.compile (`backend`, dynamic shapes)
    around its packed attention (module docstring). `graphs`: how many graphs have been compiled.
    Needs lightrft's packed attention: with another `attn_implementation` the attention would be
    traced into the layer's graph, with the host-side lengths of each micro-batch in its guards."""

    def __init__(self, model: nn.Module, backend: str, flag: str = "--pretrain"):
        if backend not in COMPILE_BACKENDS:
            raise ValueError(f"--torch_compile must be one of {', '.join(COMPILE_BACKENDS)}, got {backend!r}")
        attention = getattr(model.config, "_attn_implementation", None)
        if attention not in (VARLEN_ATTENTION, VARLEN_SDPA_LEGACY):
            raise ValueError(f"--torch_compile compiles {flag}'s decoder layers around lightrft's packed attention "
                             f"({VARLEN_ATTENTION}, the default), but the model uses {attention!r}, which would be "
                             "compiled into the layers with every micro-batch's lengths: drop --attn_implementation")
        from torch._dynamo.backends.registry import lookup_backend

        self.flag = flag
        self.backend = backend
        self._compile_graph = lookup_backend(backend)
        self.graphs = 0
        self.layers = decoder_layers(model, flag)
        if any(hasattr(param, "ds_id") for param in model.parameters()):
            # Built under DeepSpeed ZeRO-3 (`strategy.zero3_init_context`), whose hooks on every submodule
            # gather its parameters: torch.compile runs them outside its graphs, one graph per submodule.
            logger.warning("%s --torch_compile under ZeRO-3: DeepSpeed's parameter hooks on every submodule split "
                           "each layer into one graph per submodule (the same values, little fusion); under ZeRO-2 "
                           "a layer compiles into a few graphs around its attention", flag)
        compiled = {}
        for layer in self.layers:
            cls = type(layer)
            if cls not in compiled:
                compiled[cls] = compiled_subclass(cls, torch.compile(cls.forward, dynamic=True, backend=self._counted))
            layer.__class__ = compiled[cls]

    def _counted(self, graph: torch.fx.GraphModule, example_inputs: list) -> object:
        """The backend torch.compile calls once per graph it compiles: counts and logs it."""
        self.graphs += 1
        logger.info("%s --torch_compile %s: graph %d compiled (%d nodes)", self.flag, self.backend, self.graphs,
                    len(graph.graph.nodes))
        return self._compile_graph(graph, example_inputs)


def compiled_subclass(cls: type, compiled) -> type:
    """A subclass of the decoder layer class `cls`, of the same name, whose forward runs `compiled`
    (`cls.forward` under torch.compile) around the attention (`forward_around_attention`). A class
    rather than a forward set on each layer: transformers 5.25 checkpoints a layer by wrapping its
    class's `forward` (every subclass's too, so this one's: the backward's recomputation runs the
    compiled forward again), where 5.19 wraps `__call__`; and a deep copy of a layer keeps it."""
    forward = forward_around_attention(compiled, cls.forward)
    return type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})


def forward_around_attention(compiled, eager):
    """A layer forward (`layer` first) that runs `compiled` with the packed attention's keywords
    held in one `HeldKeywords`, within `RECOMPILE_LIMIT`; a forward that decodes with a KV cache
    (`generate`) runs `eager`: its cache's growth would compile again at every step."""
    def forward(layer, *args, **kwargs):
        if any(isinstance(value, Cache) for value in (*args, *kwargs.values())):
            return eager(layer, *args, **kwargs)
        # Always held, even empty: it is what keeps the attention call out of the graphs.
        kwargs[HELD_KEYWORD] = HeldKeywords({name: kwargs.pop(name) for name in PACKING_KEYWORDS if name in kwargs})
        # A patch per call (13 us): one shared between threads (an explorer thread's policy copy) would not nest.
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            return compiled(layer, *args, **kwargs)

    return forward
