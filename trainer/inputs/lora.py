"""LoRA adapters for the actor (`model.lora_rank > 0`), with peft.

`wrap` puts peft's LoRA layers into the actor's model before it is placed or sharded: the base weights are
frozen and only the adapters (lora_A, lora_B of each targeted linear layer) require grad, so only they are in
the optimizer and in checkpoints. Only the adapters keep float32 master weights: the frozen base is held in the
compute dtype (model.dtype; `freeze_base`), half the memory under bfloat16. The reference policy is the same
model with the adapters off (`base_only`), exactly the base model as held (in model.dtype).

peft renames what it wraps: `base_model.model.` in front of every name, `.base_layer` inside a targeted layer,
and the adapters beside it (`.lora_A.default.weight`, `.lora_B.default.weight`). The engines and the HF export
want the plain model's names and one weight per layer: `merged_state` turns a full state dict of the wrapped
model into the plain model's (each targeted weight W + B @ A * scale, summed in float32 and rounded once to
W's dtype), and `Adapters.merged_parameters` does the same one parameter at a time for the GPU weight sync
(rollout/weight_sync.py). peft is imported only here, and only when LoRA is on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..errors import ModelLoadError, first_line

PREFIX = "base_model.model."
ADAPTER = "default"
_BASE = ".base_layer"


def is_adapter(name: str) -> bool:
    """A LoRA parameter (lora_A, lora_B) of a wrapped model."""
    return ".lora_" in name


def base_name(name: str) -> str:
    """The plain model's name of a wrapped model's parameter (`base_model.model.x.q_proj.base_layer.weight` ->
    `x.q_proj.weight`)."""
    if name.startswith(PREFIX):
        name = name[len(PREFIX) :]
    return name.replace(_BASE + ".", ".")


@dataclass(frozen=True)
class Adapters:
    """Where a wrapped model's adapters are and how each merges: module name -> (scale, transposed). A
    transposed layer (GPT-2's Conv1D, peft's fan_in_fan_out) stores its weight as [in, out]."""

    layers: dict[str, tuple[float, bool]]

    @classmethod
    def of(cls, model: torch.nn.Module) -> Adapters:
        from peft.tuners.lora import LoraLayer

        layers = {
            name: (float(module.scaling[ADAPTER]), bool(getattr(module, "fan_in_fan_out", False)))
            for name, module in model.named_modules()
            if isinstance(module, LoraLayer)
        }
        return cls(layers)

    def _merge(self, module: str, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        scale, transposed = self.layers[module]
        delta = (b.float() @ a.float()) * scale
        if transposed:
            delta = delta.T
        return (weight.float() + delta).to(weight.dtype)

    def _module_of(self, name: str) -> str | None:
        """The adapted module whose base weight `name` is, or None."""
        suffix = _BASE + ".weight"
        module = name[: -len(suffix)] if name.endswith(suffix) else None
        return module if module in self.layers else None

    def merged_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A full state dict of the wrapped model as the plain model's: its names, every adapted weight merged,
        no adapter tensors. In the wrapped model's order."""
        out = {}
        for name, tensor in state.items():
            if is_adapter(name):
                continue
            module = self._module_of(name)
            if module is not None:
                a = state[f"{module}.lora_A.{ADAPTER}.weight"]
                b = state[f"{module}.lora_B.{ADAPTER}.weight"]
                tensor = self._merge(module, tensor, a, b)
            out[base_name(name)] = tensor
        return out

    def adapter_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The adapter tensors of a full state dict of the wrapped model."""
        return {name: t for name, t in state.items() if is_adapter(name)}

    def merged_shapes(self, model: torch.nn.Module) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(plain name, dtype, full shape) of every parameter `merged_parameters` yields, without gathering."""
        return [(base_name(n), p.dtype, tuple(p.shape)) for n, p in model.named_parameters() if not is_adapter(n)]

    def merged_parameters(
        self, model: torch.nn.Module, materialize: Callable[[torch.Tensor], torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The plain model's parameters, merged, one at a time. `materialize` turns a (sharded) parameter into its
        full tensor; under FSDP it is a collective, called in the same order on every rank."""
        params = dict(model.named_parameters())
        for name, param in params.items():
            if is_adapter(name):
                continue
            full = materialize(param)
            module = self._module_of(name)
            if module is not None:
                a = materialize(params[f"{module}.lora_A.{ADAPTER}.weight"])
                b = materialize(params[f"{module}.lora_B.{ADAPTER}.weight"])
                full = self._merge(module, full.detach(), a.detach(), b.detach())
            yield base_name(name), full


@contextlib.contextmanager
def base_only(model: torch.nn.Module) -> Iterator[None]:
    """The wrapped model computing as its base model (peft's `disable_adapter()`), with what requires grad left
    as it is: peft switches the adapters' requires_grad off while they are disabled, and FSDP2 fixes each shard
    group's gradient dtype from the parameters requiring grad at the model's first forward, which is this one
    when the reference log-probs come first (a group with none would reduce bf16 gradients into fp32 adapters)."""
    trained = [p for p in model.parameters() if p.requires_grad]
    with model.disable_adapter():
        for p in trained:
            p.requires_grad_(True)
        yield


def wrap(model: torch.nn.Module, model_cfg, seed: int) -> torch.nn.Module:
    """`model` (a causal LM, possibly on the meta device) with LoRA adapters on `model_cfg.lora_target_modules`,
    its frozen base then held in model_cfg.dtype (`freeze_base`). Every rank draws the same initial adapters
    (`seed`), as every rank reads the same base weights. Both the meta skeleton and the weights rank 0 reads
    pass through here before sharding, so their dtypes agree when rank 0 broadcasts into the shards."""
    from .models import dtype_of

    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ModelLoadError(
            f"model.lora_rank={model_cfg.lora_rank} needs the peft package on every node: pip install peft "
            f"(or set model.lora_rank=0 to train the full model)"
        ) from None
    targets = list(model_cfg.lora_target_modules)
    config = LoraConfig(
        r=model_cfg.lora_rank,
        lora_alpha=model_cfg.lora_alpha,
        target_modules="all-linear" if targets == ["all-linear"] else targets,
        lora_dropout=0.0,  # RL runs without dropout (models.disable_dropout)
        bias="none",
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            wrapped = get_peft_model(model, config)
        except ValueError as exc:  # no layer matched, or one peft cannot adapt
            raise ModelLoadError(
                f"model.lora_target_modules={targets}: {first_line(exc)[:300]}: name linear layers of the "
                f"model (e.g. q_proj,v_proj) or use all-linear"
            ) from None
    _check_layers(wrapped, targets)
    freeze_base(wrapped, dtype_of(model_cfg.dtype))
    return wrapped


def freeze_base(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Hold every frozen floating-point parameter and persistent buffer of `model` in `dtype` (the compute dtype),
    in place: they are never updated, so float32 masters would only double their memory. What trains (the
    adapters) stays float32 for the optimizer. Non-persistent buffers (rotary frequencies, computed at init) stay
    as the model made them, as in a model loaded in `dtype`. Tied parameters stay tied (the same Parameter's data
    is replaced)."""
    if dtype == torch.float32:
        return
    with torch.no_grad():
        for module in model.modules():
            for param in module.parameters(recurse=False):
                if not param.requires_grad and param.is_floating_point() and param.dtype != dtype:
                    param.data = param.data.to(dtype)
            for name, buf in module._buffers.items():
                if buf is None or name in module._non_persistent_buffers_set:
                    continue
                if buf.is_floating_point() and buf.dtype != dtype:
                    module._buffers[name] = buf.to(dtype)


def _check_layers(wrapped: torch.nn.Module, targets: list[str]) -> None:
    """Adapters only on plain linear layers whose weight is no other layer's too: what `merged_state` merges."""
    from peft.tuners.lora import Linear

    adapters = Adapters.of(wrapped)
    tied = {id(p) for p in wrapped.get_base_model().get_input_embeddings().parameters()}
    for name, module in wrapped.named_modules():
        if name not in adapters.layers:
            continue
        base = module.get_base_layer()
        if not isinstance(module, Linear) or not isinstance(base, torch.nn.Linear) or id(base.weight) in tied:
            what = "a layer tied to the input embeddings" if id(base.weight) in tied else type(base).__name__
            raise ModelLoadError(
                f"model.lora_target_modules={targets} puts an adapter on {base_name(name)} ({what}): LoRA here "
                f"adapts plain linear layers only; leave it out of the list (all-linear skips it)"
            )
