"""`model.compile`: torch.compile each transformer block of the models the trained roles run.

A causal LM's update spends much of its device time outside the matmuls, in the many small kernels of the
norms, the activation, the rotary embedding and the residual adds; at 1-2B parameters the loop is launch-bound.
Compiling each block with Inductor fuses those into a few kernels, the way large-scale trainers do it: block by
block (all blocks share one graph, so the model compiles once whatever its depth), in place (`Module.compile`,
so parameter names, checkpoints and the weight push are unchanged), around FSDP2's hooks (Dynamo leaves them
eager). Shapes are dynamic: a micro-batch of another width or a packed row reuses the graph.

The first updates pay for the compilation (tens of seconds on a GPU for a 1B model, about as long on a
CPU for the tiny one); generation inside the actor (`placement.rollout_in_actor`) runs the blocks eagerly
(`eager_blocks`), since a decode step with its cache is a different program each length. On CPU, Inductor
writes C++ and needs a compiler (g++); on CUDA it writes Triton kernels, which CUDA builds of torch bring.
"""

from __future__ import annotations

import contextlib
import shutil

import torch

from ..errors import ConfigError
from ..inputs.models import transformer_blocks


def compile_blocks(model: torch.nn.Module, device: torch.device) -> int:
    """Compile every transformer block of `model` in place; the number compiled (0: no block list found,
    nothing changed)."""
    if device.type == "cpu" and not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
        raise ConfigError(
            "model.compile=true on a CPU worker needs a C++ compiler for torch.compile, and none is on this node's "
            "PATH: install one (apt-get install g++) or set model.compile=false"
        )
    blocks = transformer_blocks(model)
    for block in blocks:
        block.compile(dynamic=True)
    return len(blocks)


def eager_blocks() -> contextlib.AbstractContextManager:
    """A context in which compiled blocks run their eager code (generation with a KV cache)."""
    return torch.compiler.set_stance("force_eager")
