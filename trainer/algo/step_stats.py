"""A step's statistics: phase timings (`Timer`), one rank's token-weighted sums and peaks (`Accumulator`), and
their merge over a role's ranks (`combine`). The workers accumulate, the loop combines and logs."""

from __future__ import annotations

import time


class Timer:
    """`with timer("rollout"):` adds `timing/rollout` seconds to the step's metrics."""

    def __init__(self):
        self.times: dict[str, float] = {}

    def __call__(self, name: str):
        timer = self

        class _Span:
            def __enter__(self):
                self.start = time.perf_counter()

            def __exit__(self, *exc):
                timer.add(name, time.perf_counter() - self.start)

        return _Span()

    def add(self, name: str, seconds: float) -> None:
        """Count `seconds` towards `timing/<name>` (negative: take them off)."""
        self.times[f"timing/{name}"] = self.times.get(f"timing/{name}", 0.0) + seconds


class Accumulator:
    """Token-weighted sums of per-micro-batch statistics on one rank, and peaks (memory); `combine` merges
    the ranks' exactly.

    A value or weight may be a 0-dim tensor on the device (detached): it is kept there, and `result` reads
    every such tensor back in one transfer per device. So an update loop that adds its statistics each
    micro-batch waits for the device once, at its end, instead of once per statistic (a `.item()` each). The
    sums come out the same as with python floats: each tensor is read as float64 (exact for float32 values
    and integer counts) and the sums are taken in python in the order the values were added."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self.peaks: dict[str, float] = {}
        self.pending: list[tuple[str, object, object]] = []
        """(name, value, weight) in the order added, resolved by `result`."""
        self.pending_peaks: list[tuple[str, object]] = []

    def add(self, name: str, value, weight) -> None:
        """Count `value` (a float or a 0-dim tensor) towards `name`'s mean with `weight` (likewise)."""
        self.pending.append((name, value, weight))

    def peak(self, name: str, value) -> None:
        """A statistic reported as its largest value (over calls and over ranks), not as a mean; a float or a
        0-dim tensor, read back with the rest by `result`."""
        self.pending_peaks.append((name, value))

    def result(self) -> dict:
        """{"sums", "weights", "peaks"} as python floats (the device is waited for here, once)."""
        flat = [x for _, value, weight in self.pending for x in (value, weight)]
        resolved = _read_back(flat + [value for _, value in self.pending_peaks])
        for i, (name, _, _) in enumerate(self.pending):
            value, weight = resolved[2 * i], resolved[2 * i + 1]
            self.sums[name] = self.sums.get(name, 0.0) + value * weight
            self.weights[name] = self.weights.get(name, 0.0) + weight
        for (name, _), value in zip(self.pending_peaks, resolved[len(flat) :]):
            self.peaks[name] = max(self.peaks.get(name, value), value)
        self.pending = []
        self.pending_peaks = []
        return {"sums": self.sums, "weights": self.weights, "peaks": self.peaks}


def _read_back(items: list) -> list[float]:
    """`items` as python floats: tensors stacked per device (as float64) and copied to the host once per device."""
    out = [x if not hasattr(x, "detach") else None for x in items]
    by_device: dict = {}
    for i, x in enumerate(items):
        if out[i] is None:
            by_device.setdefault(x.device, []).append(i)
    for indices in by_device.values():
        import torch  # only where a tensor was added: the driver's own metrics never import torch here

        stacked = torch.stack([items[i].detach().reshape(()).to(torch.float64) for i in indices])
        for i, v in zip(indices, stacked.tolist()):
            out[i] = v
    return [float(v) for v in out]


def combine(results: list[dict]) -> dict:
    """Token-weighted means over ranks of the statistics workers accumulated, and the largest of their peaks
    (the rank closest to running out of memory is the one to read)."""
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    peaks: dict[str, float] = {}
    for r in results:
        for k, v in r["sums"].items():
            sums[k] = sums.get(k, 0.0) + v
            weights[k] = weights.get(k, 0.0) + r["weights"][k]
        for k, v in r.get("peaks", {}).items():
            peaks[k] = max(peaks.get(k, v), v)
    return {**{k: sums[k] / weights[k] if weights[k] else float("nan") for k in sums}, **peaks}
