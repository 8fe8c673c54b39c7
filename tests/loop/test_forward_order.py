"""The step's forward passes before the update (driver.Trainer.logprobs_and_values), in process with recording
stand-ins for the role groups: the critic's values are sent before the driver waits on the actor's log-probs,
so the two roles compute side by side, except where the critic shares the actor's GPUs (sglang-2x8's
placement.colocate_all): there the critic's are sent only once the actor's are in. A GPU run itself is not
made here (no GPU); the order of the calls is what decides whether two roles' activations meet on one GPU."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from cloudrl.trainer import driver
from cloudrl.trainer.algo.batch import Batch
from cloudrl.trainer.algo.step_stats import Timer
from cloudrl.trainer.config import load_config


class Recorder:
    """A role's one worker: each call is logged, and answers with one value per row."""

    def __init__(self, role: str, log: list):
        self.role, self.log = role, log

    def __getattr__(self, method: str):
        def remote(part):
            self.log.append(f"send {self.role}.{method}")
            return torch.full((part.size, part["response_mask"].shape[1]), float(len(self.log)))

        return SimpleNamespace(remote=remote)


def group(role: str, log: list) -> SimpleNamespace:
    return SimpleNamespace(name=role, world_size=1, workers=[Recorder(role, log)], labels=lambda: [f"{role} rank 0"])


def forward_order(cfg, monkeypatch) -> tuple[list[str], Batch]:
    log: list[str] = []

    def wait(phase, calls, labels, what, started=None):
        log.append(f"wait {phase}")
        return calls

    monkeypatch.setattr(driver.WATCH, "wait", wait)
    trainer = object.__new__(driver.Trainer)
    trainer.cfg, trainer.gap_checked, trainer.global_step = cfg, True, 1
    trainer.roles = SimpleNamespace(actor=group("actor", log), critic=group("critic", log), reference=None)
    batch = Batch(
        input_ids=torch.zeros(4, 6, dtype=torch.long),
        attention_mask=torch.ones(4, 6, dtype=torch.long),
        response_mask=torch.ones(4, 3),
    )
    trainer.logprobs_and_values(batch, Timer())
    return log, batch


def test_the_critic_computes_beside_the_actor(monkeypatch):
    cfg = load_config("gsm8k-7b")  # PPO, the critic on GPUs of its own
    assert cfg.uses_critic and cfg.uses_reference and not cfg.critic_after_actor
    log, batch = forward_order(cfg, monkeypatch)
    assert log.index("send critic.values") < log.index("wait actor logprobs"), log
    assert log.index("send critic.values") < log.index("wait actor ref_logprobs"), log
    assert {"old_logprobs", "ref_logprobs", "values"} <= set(batch)


def test_on_shared_gpus_the_critic_waits_for_the_actor(monkeypatch):
    cfg = load_config("sglang-2x8")  # PPO, the critic colocated with the actor and the engines
    assert cfg.uses_critic and cfg.critic_after_actor
    log, batch = forward_order(cfg, monkeypatch)
    assert log.index("wait actor ref_logprobs") < log.index("send critic.values"), log
    assert log[-2:] == ["send critic.values", "wait critic values"]
    assert "values" in batch
