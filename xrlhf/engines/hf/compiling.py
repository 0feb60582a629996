"""``compile: true``: torch.compile each block of the model's layer stack (regional compilation).

Why: a small model's train step on a GPU is bound by the host, not by the GPU (docs/training.md
has the figures), because every decoder layer's
forward and backward are dozens of small operations (norms, rotary embeddings, the MLP's
activation, residual adds), each a Python call and a kernel launch. Inductor fuses them into a
few kernels. Compiling the repeated block, not the whole model, is PyTorch's *regional
compilation*: the blocks share one code object, so one compilation serves every layer
(``inline_inbuilt_nn_modules``), and the compile time is one block's. Shapes are dynamic
(``dynamic=True``): a packed micro-batch's token count changes every call and must not
recompile.

What is compiled is the block's own forward (attention through the engine's attention function
included); the embeddings, the head and the logprob chunks stay eager. The first micro-batch of
each kind (train with gradients, infer without) pays the compilation; inductor keeps it in its
on-disk cache, which a restarted worker on the same machine reuses: under the run's cache
directory (``EngineSpec.cache_dir``, ``use_cache_dir``) when the runner gives one, else in
inductor's default ``/tmp/torchinductor_<user>`` (or ``TORCHINDUCTOR_CACHE_DIR``).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch



def use_cache_dir(cache_dir: str | None) -> str | None:
    """Point inductor's on-disk caches (compiled graphs, AOTAutograd, Triton kernels) at
    ``<cache_dir>/torchinductor`` through ``TORCHINDUCTOR_CACHE_DIR``, which inductor reads at each
    compilation; returns that directory (``None``: ``cache_dir`` is ``None`` and nothing changes).
    The runner gives a ``cache_dir`` only where the user has not chosen one."""
    if cache_dir is None:
        return None
    path = Path(cache_dir, "torchinductor").absolute()
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    return str(path)


def layer_stack(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The model's decoder blocks: the first ``ModuleList`` (in module order) of two or more
    modules of one class (``model.layers`` of Llama / Qwen2, ``transformer.h`` of GPT-2, under a
    PEFT wrapper too); ``None`` if there is none."""
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) >= 2 and len({type(m) for m in module}) == 1:
            return module
    return None


def compile_layers(model: torch.nn.Module) -> str:
    """Compile every block of ``model``'s layer stack in place (``nn.Module.compile``, dynamic
    shapes); returns what was compiled, for the engine's log line.

    Raises:
        ValueError: the model has no layer stack to compile.
    """
    stack = layer_stack(model)
    if stack is None:
        raise ValueError(f"compile: true: {type(model).__name__} has no stack of repeated layers to compile; "
                         f"set compile: false")
    for layer in stack:
        layer.compile(dynamic=True)
    return f"{len(stack)} x {type(stack[0]).__name__} compiled (torch.compile, dynamic shapes)"
