"""Metric sinks: a console line per step, a JSONL file, TensorBoard, and W&B and MLflow when configured.

Names carry their namespace (`rollout/reward_mean`, `actor/pg_loss`, `timing/step`). The console
line has a fixed shape that `cloudrl status` reads back from the job logs:

    step 3/40 [###.......] | rollout/reward_mean=0.531 actor/pg_loss=-0.012 ... | 1.23 s/step

W&B and MLflow go through trackers.py (one tracker run per timeline of the run_dir). Also: the sampled
prompt and response shown every `trainer.sample_every` steps, and the run's summary and evaluation text.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from .trackers import TRACKERS, TrackerRun, current_timeline_of, read_record, start_mlflow, start_wandb, write_record

CONSOLE_KEYS = (
    "rollout/reward_mean",
    "val/reward_mean",
    "rollout/response_length",
    "actor/pg_loss",
    "actor/approx_kl",
    "actor/entropy",
    "critic/vf_loss",
    "critic/explained_var",
    "perf/tokens_per_s",
)
CONSOLE_WHEN_NONZERO = ("env/env_errors_per_sample",)
"""Shown on the console line only in a step where they are above 0."""


class MetricsLogger:
    def __init__(self, cfg, run_dir: str, resumed_step: int = 0):
        self.total = cfg.trainer.total_steps
        self.sinks = set(cfg.trainer.loggers)
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = None
        if "jsonl" in self.sinks:
            keep_rows_up_to(self.run_dir / "metrics.jsonl", resumed_step)
            self.jsonl = open(self.run_dir / "metrics.jsonl", "a")
        self.tb = None
        if "tensorboard" in self.sinks:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=resumed_step + 1 or None)
        self.trackers: list[TrackerRun] = []
        self.record_path = self.run_dir / TRACKERS
        self.record: dict = {}
        if self.sinks & {"wandb", "mlflow"}:
            self.record = read_record(self.record_path)
            timeline = current_timeline_of(run_dir)
            for name, start in (("wandb", start_wandb), ("mlflow", start_mlflow)):
                if name in self.sinks:
                    tracker = start(cfg, timeline, self.record.get(name))
                    if tracker is not None:
                        tracker.announce(resumed_step)
                        self.trackers.append(tracker)
            self._save_record()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: float(v) for k, v in metrics.items()}
        if self.jsonl:
            self.jsonl.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")
            self.jsonl.flush()
        if self.tb:
            for k, v in clean.items():
                if math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if any([tracker.log(step, clean) for tracker in self.trackers]):  # a list: every tracker gets the step
            self._save_record()
        if "console" in self.sinks:
            print(self.console_line(step, clean), flush=True)

    def console_line(self, step: int, metrics: dict[str, float]) -> str:
        filled = round(10 * step / max(self.total, 1))
        bar = "#" * filled + "." * (10 - filled)
        keys = [*CONSOLE_KEYS, *(k for k in CONSOLE_WHEN_NONZERO if metrics.get(k, 0) > 0)]
        shown = " ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics)
        secs = metrics.get("timing/step")
        return f"step {step}/{self.total} [{bar}] | {shown}" + (f" | {secs:.2f} s/step" if secs else "")

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()
        for tracker in self.trackers:
            tracker.close(complete=tracker.last_step >= self.total)

    def _save_record(self) -> None:
        for tracker in self.trackers:
            self.record[tracker.key] = tracker.entry()
        if self.trackers:
            write_record(self.record_path, self.record)


def keep_rows_up_to(path: Path, resumed_step: int) -> None:
    """Before a run (re)starts at `resumed_step`: drop the rows of `path` that it will log again, so that
    no step has two rows. Those are the rows past the checkpoint it resumes from (logged by a run that
    stopped before saving them, or by the timeline of a later checkpoint), and every row of a run that
    starts from step 0. A line cut short by a crash goes too. Rewritten atomically; no file, nothing."""
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
    kept = []
    for line in lines:
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            continue
        if line.endswith("\n") and resumed_step > 0 and isinstance(step, int) and step <= resumed_step:
            kept.append(line)
    if len(kept) == len(lines):
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)


def print_sample(
    step: int, every: int, prompt: str, tokenizer, response_ids: list[int], reward: float, loss_mask=None
) -> None:
    """On step 1 and every `every` steps after (trainer.sample_every; 0: never), one sampled prompt, its response
    and its reward, so the job log shows what the model is asked and says, not only averages. A multi-turn
    episode (a `loss_mask` with observation tokens, 0) shows its turns apart: the model's text, then `| env`
    and the observation, in turn order. The response is decoded only on those steps: the step pays nothing
    otherwise."""
    if every > 0 and (step % every == 1 or every == 1):
        shown = " | ".join(
            f"env {text!r}" if observed else repr(text) for observed, text in _turns(tokenizer, response_ids, loss_mask)
        )
        print(f"sample: prompt {prompt[-200:]!r} -> response {shown[:400]}, reward {reward:.4g}", flush=True)


def _turns(tokenizer, ids: list[int], loss_mask) -> list[tuple[bool, str]]:
    """(is an observation, its text) for each run of the model's own tokens and of observation tokens."""
    if not loss_mask or all(loss_mask):
        return [(False, tokenizer.decode(ids, skip_special_tokens=True))]
    runs: list[tuple[bool, list[int]]] = []
    for token, trained in zip(ids, loss_mask):
        observed = not trained
        if runs and runs[-1][0] == observed:
            runs[-1][1].append(token)
        else:
            runs.append((observed, [token]))
    return [(observed, tokenizer.decode(part, skip_special_tokens=True)) for observed, part in runs]


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def format_summary(s: dict) -> str:
    lines = [
        "summary:",
        f"  steps:            {s['steps']}" + (f" (resumed at step {s['resumed_from']})" if s["resumed_from"] else ""),
    ]
    lines.append(
        f"  val reward:       {_fmt(s['val_reward_before_rl'])} before RL -> {_fmt(s['val_reward_after_rl'])} "
        f"after (greedy, held-out prompts)"
    )
    lines.append(
        f"  rollout reward:   {_fmt(s['rollout_reward_first'])} first step -> {_fmt(s['rollout_reward_last'])} last step"
    )
    lines.append(f"  checkpoint:       {s['checkpoint']}")
    lines.append(f"  exported model:   {s['exported_model'] or 'off (trainer.export_hf=false)'}")
    lines.append(f"  metrics:          {s['metrics']}")
    return "\n".join(lines)


def format_eval_table(model: str, step: int, metrics: dict) -> str:
    """One row per validation set, one column per statistic (val/<name>/<stat> or val/<stat>)."""
    rows: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        parts = key.split("/")
        name, stat = ("val", parts[1]) if len(parts) == 2 else (parts[1], parts[2])
        rows.setdefault(name, {})[stat] = value
    if len(rows) > 1 and "val" in rows and set(rows["val"]) == {"reward_mean"}:
        del rows["val"]  # only the first named set's reward again
    stats = list(dict.fromkeys(stat for row in rows.values() for stat in row))
    width = max(len(name) for name in rows) + 2
    lines = [f"evaluation of {model} (step {step})", "set".ljust(width) + "  ".join(s.rjust(8) for s in stats)]
    for name, row in rows.items():
        cells = [f"{row[s]:.4g}".rjust(max(8, len(s))) if s in row else "-".rjust(max(8, len(s))) for s in stats]
        lines.append(name.ljust(width) + "  ".join(cells))
    return "\n".join(lines)
