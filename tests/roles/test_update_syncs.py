"""An update reads its statistics back from the device once, not once per micro-batch: counted as the calls
that copy a tensor's value to the host (`.item()`, `.tolist()`, `float()`, `int()`, `bool()`) made by cloudrl's
own code during an in-process update (one rank, no Ray), with one micro-batch and with four. On a GPU each
such call waits for every kernel queued before it. The same update reports its MFU and that of the forward-only
pass before it, with trainer.peak_tflops standing in for a GPU's peak."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest
import torch
from cloudrl.trainer.algo.batch import build_batch, update_shards
from cloudrl.trainer.algo.step_stats import Accumulator
from cloudrl.trainer.config import load_config
from cloudrl.trainer.inputs.models import resolve_path
from cloudrl.trainer.roles.workers import CriticWorker, PolicyWorker

TRAINER = str(Path(sys.modules["cloudrl.trainer"].__file__).parent)
READS = ("item", "tolist", "__float__", "__int__", "__bool__")


def reads_during(monkeypatch, run) -> collections.Counter:
    """The host reads cloudrl's code makes while `run()` runs, by the file and line that made them."""
    calls: collections.Counter = collections.Counter()
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(TRAINER):
                calls[f"{caller.removeprefix(TRAINER)}:{sys._getframe(1).f_lineno}"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    try:
        run()
    finally:
        monkeypatch.undo()
    return calls


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_host_reads_do_not_grow_with_micro_batches(monkeypatch, role):
    keys = ["mini_batch_size=8", "micro_batch_size=8"]
    overrides = [f"{r}.{k}" for r in ("actor", "critic") for k in keys]
    # every statistic of the actor's loop: importance weights against the engine's log-probs, the KL loss
    overrides += ["data.train_batch_size=1", "model.sft_warmup_steps=0", "rollout.logprob_correction=true"]
    overrides += ["algorithm.kl_mode=loss", "algorithm.kl_coef=0.1", "trainer.peak_tflops=0.001"]  # MFU on a CPU
    cfg = load_config("local", overrides)
    path = resolve_path(cfg.model.path, cfg)
    worker = PolicyWorker(cfg.to_dict(), path) if role == "actor" else CriticWorker(cfg.to_dict(), path)
    worker.start_training()
    batch = build_batch([[5, 6, 7]] * 8, [[8, 9, 10]] * 8, pad_id=0)
    for key in ("advantages", "values", "returns", "ref_logprobs", "engine_logprobs"):
        batch[key] = torch.full(batch["response_mask"].shape, -0.5) * batch["response_mask"]
    shards, norms = update_shards(batch, 1, getattr(cfg, role), seed=0)

    def update(micro: int) -> collections.Counter:
        getattr(worker.cfg, role).micro_batch_size = micro
        worker.logprobs(batch) if role == "actor" else worker.values(batch)  # a forward-only pass before it
        got = {}

        def run():
            args = (shards[0], norms, 0.1) if role == "actor" else (shards[0], norms)
            got["stats"] = worker.update(*args).stats

        calls = reads_during(monkeypatch, run)
        assert got["stats"]["weights"][f"{role}/grad_norm"] == 1.0  # the update ran: one optimizer step
        assert got["stats"]["sums"][f"perf/{role}_mfu"] > 0 and got["stats"]["sums"][f"perf/{role}_forward_mfu"] > 0
        return calls

    one, four = update(8), update(2)
    assert sum(four.values()) == sum(one.values()), f"1 micro-batch: {dict(one)}; 4: {dict(four)}"
    # what is left: the gradient norm (once per mini-batch), the tokens/s, MFU's token counts (host tensors)
    # and the one read-back of the statistics
    assert sum(one.values()) <= 5, dict(one)


def test_tensor_statistics_are_read_back_once_and_sum_as_floats_do():
    values = [torch.tensor(0.1, dtype=torch.float32), torch.tensor(2.5), 0.75]
    weights = [torch.tensor([1.0, 1.0, 0.0]).sum(), 3, torch.tensor(4, dtype=torch.int64)]
    lazy, eager = Accumulator(), Accumulator()
    for v, w in zip(values, weights):
        lazy.add("x", v, w)
        eager.add("x", float(v), float(w))
    lazy.add("n", 1.0, 1.0)
    assert lazy.result()["sums"]["x"] == eager.result()["sums"]["x"] == float(values[0]) * 2 + 2.5 * 3 + 0.75 * 4
    assert lazy.result()["weights"] == {"x": 9.0, "n": 1.0}  # a second result() adds nothing again
