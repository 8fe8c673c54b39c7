"""Model FLOPs utilisation (MFU): the FLOPs a pass needs by the model's shape, per second, over the device's peak.

    flops = transformer_flops(seq_lens, params, layers, hidden, training=True)
    peak = peak_flops(device, compute_dtype, cfg.trainer.peak_tflops)   # None: not known, MFU not reported
    mfu = flops / seconds / peak

The FLOPs are the model's, not the hardware's: what the pass needs, counted from its shape (PaLM's
estimate, Chowdhery et al. 2022, appendix B), whatever the kernels or gradient checkpointing do on top.
The peak is the device's dense 16-bit (or fp32, TF32) tensor throughput from its data sheet, looked up
by `torch.cuda.get_device_name()`; on a CPU or a GPU not in the table it is unknown unless
`trainer.peak_tflops` names it. No Ray here, and torch only where a device is asked about.
"""

from __future__ import annotations

from collections.abc import Iterable

# Dense (no sparsity) peak TFLOPs per GPU from the vendors' data sheets: 16-bit (bf16, or fp16 where the
# GPU has no bf16), TF32 (fp32 matmuls on tensor cores) and plain fp32. Matched in order against
# torch.cuda.get_device_name(), case-insensitively: a longer name before any name it contains.
PEAK_TFLOPS: tuple[tuple[str, float, float, float], ...] = (
    # name in the device name, 16-bit, tf32, fp32
    ("H100 PCIe", 756.0, 378.0, 51.2),
    ("H100 NVL", 835.0, 417.5, 60.0),
    ("H100", 989.4, 494.7, 66.9),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H200", 989.4, 494.7, 66.9),  # also GH200's GPU
    ("H800", 989.4, 494.7, 66.9),
    ("A100", 312.0, 156.0, 19.5),
    ("A800", 312.0, 156.0, 19.5),
    ("L40S", 362.0, 183.0, 91.6),
    ("L40", 181.0, 90.5, 90.5),
    ("A10G", 125.0, 62.5, 31.2),
    ("A10", 125.0, 62.5, 31.2),
    ("L4", 121.0, 60.0, 30.3),
    ("V100", 125.0, 15.7, 15.7),  # fp16 tensor cores; no bf16, no TF32
)


def transformer_flops(seq_lens: Iterable[int], params: int, layers: int, hidden: int, training: bool = True) -> float:
    """FLOPs of one pass of a decoder-only transformer over sequences of `seq_lens` tokens each.

    Per token of a sequence of length s:
      training (forward + backward)   6 * params + 12 * layers * hidden * s
      forward only                    2 * params +  4 * layers * hidden * s
    `params` are the parameters that take part in a matrix product per token (`matmul_params`): each costs
    2 FLOPs (multiply and add) forward and 4 backward (the gradients of the activations and of the weight).
    The second term is attention's two products with every earlier position (QK^T and attention times V,
    2 * 2 * hidden * s per layer forward), counted over the whole sequence as PaLM does (the causal mask
    halves the work actually needed). So a sequence costs s * 6 * params + 12 * layers * hidden * s^2 to
    train. Under LoRA the frozen weights need no weight gradients (about 4 * params would do): the
    training count then overstates the work by up to a third."""
    per_param, attention = (6, 12) if training else (2, 4)
    total = 0
    for s in seq_lens:
        total += s * per_param * params + attention * layers * hidden * s * s
    return float(total)


def matmul_params(model) -> int:
    """The parameters a token's pass multiplies by: all but the embedding tables (a lookup each), with the
    output projection counted even when it shares the input embedding's weight (a vocabulary-wide product).
    Global counts: a sharded (FSDP2) parameter's numel is its full tensor's."""
    import torch

    lookups = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    count = sum(p.numel() for p in model.parameters() if id(p) not in lookups)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and id(head.weight) in lookups:  # tied: the weight is a lookup and a product
        count += head.weight.numel()
    return count


def model_shape(model) -> tuple[int, int, int] | None:
    """(matmul params, layers, hidden size) of a transformers model, or None where its config does not say."""
    config = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", None)
    hidden = getattr(config, "hidden_size", None)
    if not layers or not hidden:
        return None
    return matmul_params(model), int(layers), int(hidden)


def table_peak(device_name: str, dtype: str) -> float | None:
    """Peak FLOP/s of the GPU called `device_name` for matmuls in `dtype` ("16bit", "tf32" or "fp32"),
    from PEAK_TFLOPS; None for a GPU not in it."""
    column = {"16bit": 1, "tf32": 2, "fp32": 3}[dtype]
    name = device_name.lower()
    for row in PEAK_TFLOPS:
        if row[0].lower() in name:
            return row[column] * 1e12
    return None


def peak_flops(device, compute_dtype, peak_tflops: float = 0.0) -> float | None:
    """This worker's device's peak FLOP/s for its compute dtype: `peak_tflops` (trainer.peak_tflops) when it
    is set, else the table's for a CUDA device; None (MFU not reported) on a CPU or an unknown GPU."""
    if peak_tflops > 0:
        return peak_tflops * 1e12
    if getattr(device, "type", str(device)) != "cuda":
        return None
    import torch

    if compute_dtype in (torch.bfloat16, torch.float16):
        kind = "16bit"
    elif torch.get_float32_matmul_precision() != "highest":  # fp32 matmuls on TF32 tensor cores
        kind = "tf32"
    else:
        kind = "fp32"
    return table_peak(torch.cuda.get_device_name(device), kind)


class Utilisation:
    """A worker's FLOPs meter: the model's shape once, the device's peak once, and the forward-only passes
    (log-probs, values) counted between two updates.

        meter = Utilisation(model, device, compute_dtype, cfg.trainer.peak_tflops)
        meter.forward(attention_mask, seconds)     # each forward-only call
        meter.mfu(attention_mask, seconds)         # an update's, or None
        meter.forward_mfu()                        # the forward-only calls' since the last, or None
    """

    def __init__(self, model, device, compute_dtype, peak_tflops: float = 0.0):
        self.shape = model_shape(model)
        self.peak = peak_flops(device, compute_dtype, peak_tflops) if self.shape else None
        self.forward_flops = 0.0
        self.forward_seconds = 0.0

    def flops(self, attention_mask, training: bool) -> float:
        """The pass's FLOPs over the rows of `attention_mask` [N, L] (their real tokens; a CPU tensor)."""
        return transformer_flops(attention_mask.sum(1).tolist(), *self.shape, training=training)

    def forward(self, attention_mask, seconds: float) -> None:
        if self.peak:
            self.forward_flops += self.flops(attention_mask, training=False)
            self.forward_seconds += seconds

    def mfu(self, attention_mask, seconds: float) -> float | None:
        if not self.peak or seconds <= 0:
            return None
        return self.flops(attention_mask, training=True) / seconds / self.peak

    def forward_mfu(self) -> float | None:
        """MFU of the forward-only calls since the last call of this (then counted afresh)."""
        flops, seconds = self.forward_flops, self.forward_seconds
        self.forward_flops = self.forward_seconds = 0.0
        if not self.peak or seconds <= 0:
            return None
        return flops / seconds / self.peak
