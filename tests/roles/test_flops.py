"""MFU's parts (roles/flops.py): the FLOPs of a pass from the model's shape, against a hand count; the
parameters that count; the device peaks by GPU name and compute dtype; none on a CPU unless
trainer.peak_tflops says. Pure functions and a tiny model, no GPU."""

from __future__ import annotations

import pytest
import torch
from cloudrl.trainer.roles import flops


def test_transformer_flops_against_a_hand_count():
    # Two sequences of 3 and 5 tokens, 100 matmul params, 2 layers, hidden 8:
    #   training: 6 * 100 * (3 + 5) + 12 * 2 * 8 * (3^2 + 5^2) = 4800 + 6528
    #   forward:  2 * 100 * (3 + 5) +  4 * 2 * 8 * (3^2 + 5^2) = 1600 + 2176
    assert flops.transformer_flops([3, 5], params=100, layers=2, hidden=8) == 11328.0
    assert flops.transformer_flops([3, 5], params=100, layers=2, hidden=8, training=False) == 3776.0
    assert flops.transformer_flops([], params=100, layers=2, hidden=8) == 0.0


def _llama(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config)


@pytest.mark.parametrize("tied", [False, True])
def test_matmul_params_leave_out_the_lookup_and_keep_the_output_projection(tied):
    model = _llama(tied)
    everything = sum(p.numel() for p in model.parameters())  # tied: the shared table once
    table = 50 * 16
    assert flops.matmul_params(model) == everything - table + (table if tied else 0)
    assert flops.model_shape(model) == (flops.matmul_params(model), 2, 16)


@pytest.mark.parametrize(
    ("name", "kind", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "16bit", 989.4),
        ("NVIDIA H100 PCIe", "16bit", 756.0),
        ("NVIDIA H200", "16bit", 989.4),
        ("NVIDIA A100-SXM4-80GB", "16bit", 312.0),
        ("NVIDIA A100-SXM4-80GB", "fp32", 19.5),
        ("NVIDIA A100-SXM4-80GB", "tf32", 156.0),
        ("NVIDIA L40S", "16bit", 362.0),
        ("NVIDIA L4", "16bit", 121.0),
        ("NVIDIA A10G", "16bit", 125.0),
        ("NVIDIA H100 80GB HBM3", "fp32", 66.9),
    ],
)
def test_table_peaks_by_device_name(name, kind, tflops):
    assert flops.table_peak(name, kind) == pytest.approx(tflops * 1e12)


def test_an_unknown_gpu_or_a_cpu_has_no_peak_unless_one_is_given(monkeypatch):
    assert flops.table_peak("Some Future GPU", "16bit") is None
    assert flops.peak_flops(torch.device("cpu"), torch.bfloat16) is None
    assert flops.peak_flops(torch.device("cpu"), torch.float32, peak_tflops=2.5) == 2.5e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert flops.peak_flops(torch.device("cuda"), torch.bfloat16) == pytest.approx(989.4e12)
    assert flops.peak_flops(torch.device("cuda"), torch.float32) == pytest.approx(66.9e12)  # torch's default: no TF32
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert flops.peak_flops(torch.device("cuda"), torch.float32) == pytest.approx(494.7e12)


def test_utilisation_of_an_update_and_of_the_forward_passes():
    model = _llama(False)
    meter = flops.Utilisation(model, torch.device("cpu"), torch.float32, peak_tflops=1e-6)  # 1e6 FLOP/s
    params = flops.matmul_params(model)
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])  # 3 and 4 real tokens
    train = 6 * params * 7 + 12 * 2 * 16 * (9 + 16)
    assert meter.mfu(mask, seconds=2.0) == pytest.approx(train / 2.0 / 1e6)
    assert meter.forward_mfu() is None  # no forward-only pass yet
    meter.forward(mask, 1.0)
    meter.forward(mask[:1], 1.0)
    forward = 2 * params * 10 + 4 * 2 * 16 * (9 + 16 + 9)
    assert meter.forward_mfu() == pytest.approx(forward / 2.0 / 1e6)
    assert meter.forward_mfu() is None  # counted afresh after each read
    assert flops.Utilisation(model, torch.device("cpu"), torch.float32).mfu(mask, 2.0) is None  # CPU: no peak
