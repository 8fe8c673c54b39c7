"""Metric sinks: a console line per step, a JSONL file, TensorBoard, and W&B and MLflow when configured.

Names carry their namespace (`rollout/reward_mean`, `actor/pg_loss`, `timing/step`). The console
line has a fixed shape that `cloudrl status` reads back from the job logs:

    step 3/40 [###.......] | rollout/reward_mean=0.531 actor/pg_loss=-0.012 ... | 1.23 s/step

W&B and MLflow ("trackers") log one tracker run per timeline of the run_dir (timeline.py's run id):
resumes and restarts that continue the timeline continue its tracker run, a new timeline (a fresh start,
a resume from a chosen checkpoint) starts a new one. A tracker run holds each step once: steps a restart
runs again (logged before the loss, after the checkpoint it resumes from) keep their first values there.
`run_dir/trackers.json` records, per tracker, its run and the last step it holds.

Also: `Accumulator` and `combine` (a rank's token-weighted statistics and peaks, and their means and
maxima over a role's ranks) and the run's summary text.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from .errors import first_line

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
            timeline = _timeline(run_dir)
            for name, start in (("wandb", _start_wandb), ("mlflow", _start_mlflow)):
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


# ----------------------------------------------------------------------------------------------
# Trackers: W&B and MLflow
# ----------------------------------------------------------------------------------------------

TRACKERS = "trackers.json"
"""run_dir/trackers.json: per tracker (wandb, mlflow), the timeline it logs, its run there and the last
step that run holds."""

_SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL", re.IGNORECASE)
_USERINFO = re.compile(r"\b([a-zA-Z][\w+.-]*://)[^/@\s]+@")
MLFLOW_PARAM_CHARS = 500
"""Longest MLflow param value sent (every MLflow server takes this many); run_dir/config.yaml has the rest."""


@dataclass
class TrackerRun:
    """The W&B or MLflow run that this run_dir's timeline logs to, and the last step it holds (-1: none)."""

    key: str
    """Its entry in trackers.json: wandb or mlflow."""
    label: str
    """W&B or MLflow, in lines for people."""
    run_id: str
    timeline: str | None
    last_step: int
    send: Callable[[int, dict[str, float]], None]
    finish: Callable[[bool], None]
    where: dict = field(default_factory=dict)
    """What must also match for a later start to continue this run (the W&B project and entity)."""
    off: bool = False

    def announce(self, resumed_step: int) -> None:
        if self.last_step < 0:
            print(f"metrics: {self.label} run {self.run_id}", flush=True)
        elif self.last_step > resumed_step:
            print(
                f"metrics: {self.label} run {self.run_id} continues; it holds steps up to {self.last_step}, so "
                f"steps {resumed_step + 1}..{self.last_step} run again keep their first values there",
                flush=True,
            )
        else:
            print(f"metrics: {self.label} run {self.run_id} continues at step {resumed_step + 1}", flush=True)

    def log(self, step: int, metrics: dict[str, float]) -> bool:
        """Send one step's metrics unless the run holds that step already (W&B takes no step twice nor out of
        order; MLflow is held to the same so both show the same curve). True when sent."""
        if self.off or step <= self.last_step:
            return False
        try:
            self.send(step, metrics)
        except Exception as exc:  # a tracker that fails costs its curves, never the training run
            self.off = True
            _warn(
                f"{self.label} failed at step {step} ({_masked(first_line(exc))}); logging to {self.label} is off "
                "for the rest of this run, the other loggers go on."
            )
            return False
        self.last_step = step
        return True

    def close(self, complete: bool) -> None:
        try:
            self.finish(complete)
        except Exception as exc:
            _warn(f"{self.label} did not close its run {self.run_id} ({_masked(first_line(exc))}).")

    def entry(self) -> dict:
        return {"timeline": self.timeline, "run": self.run_id, "step": self.last_step, **self.where}


def read_record(path: Path) -> dict:
    """trackers.json as a dict ({} when absent or unreadable: every tracker starts a new run)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_record(path: Path, record: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)


def continued(entry, timeline: str | None, where: dict) -> tuple[str | None, int]:
    """From a tracker's trackers.json entry: the run this timeline logged to (None: none yet, or in
    another project or experiment) and the last step it holds."""
    if timeline is None or not isinstance(entry, dict) or entry.get("timeline") != timeline:
        return None, -1
    if not isinstance(entry.get("run"), str) or any(entry.get(k) != v for k, v in where.items()):
        return None, -1
    step = entry.get("step")
    return entry["run"], step if isinstance(step, int) else -1


def without_secrets(value):
    """`value` (the config as a dict) with what must never reach a tracker masked: credentials written into
    a URL (scheme://user:password@host) and the value of any secret-named environment variable
    (...KEY, ...TOKEN, ...SECRET, ...PASSWORD) that a string holds. The config holds no secrets: this keeps
    one typed into a key by mistake off the tracker."""
    found = {v for name, v in os.environ.items() if _SECRET_NAME.search(name) and len(v) >= 8}
    secrets = sorted(found, key=len, reverse=True)

    def scrub(v):
        if isinstance(v, dict):
            return {k: scrub(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [scrub(x) for x in v]
        if isinstance(v, str):
            v = _USERINFO.sub(r"\1***@", v)
            for secret in secrets:
                v = v.replace(secret, "***")
        return v

    return scrub(value)


def flatten(tree: dict, prefix: str = "") -> dict:
    """{"trainer": {"seed": 1}} -> {"trainer.seed": 1}."""
    flat = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            flat.update(flatten(v, f"{prefix}{k}."))
        else:
            flat[f"{prefix}{k}"] = v
    return flat


def _masked(text: str) -> str:
    return without_secrets(text)


def _warn(line: str) -> None:
    print(f"warning: {line}", file=sys.stderr, flush=True)


def _timeline(run_dir: str):
    """The timeline this run logs (timeline.py decided it before the run started); None outside a run."""
    from .state.timeline import current_timeline

    return current_timeline(run_dir)


def _start_wandb(cfg, timeline, entry) -> TrackerRun | None:
    """The W&B run of this timeline: its id is the timeline's run id, so a resume or restart that continues
    the timeline continues the run (resume="allow"), even when trackers.json was lost with the disk."""
    offline = os.environ.get("WANDB_MODE", "") in ("offline", "dryrun", "disabled")
    if not offline and not os.environ.get("WANDB_API_KEY"):
        _warn(
            "trainer.loggers has wandb but WANDB_API_KEY is not set; pass it with "
            "`cloudrl submit --env WANDB_API_KEY`. Logging to W&B is off."
        )
        return None
    try:
        import wandb
    except ImportError:
        _warn("trainer.loggers has wandb but the wandb package is missing (pip install wandb); logging to W&B is off.")
        return None
    tc = cfg.trainer
    where = {"project": tc.wandb_project or "cloudrl", "entity": tc.wandb_entity}
    timeline_id = timeline.run_id if timeline is not None else None
    _, last = continued(entry, timeline_id, where)
    # The key stays in the environment, where wandb reads it; it is never printed or saved.
    try:
        run = wandb.init(
            project=where["project"],
            entity=tc.wandb_entity or None,
            group=_masked(tc.wandb_group) or None,
            name=_masked(tc.wandb_run_name or Path(tc.run_dir).name),
            id=timeline_id or wandb.util.generate_id(),
            resume="allow",
            dir=os.environ.get("WANDB_DIR") or tc.run_dir,
        )
        # After init, not in it: a resumed run's config takes the values this run changed (total_steps).
        config = without_secrets(cfg.to_dict())
        config["timeline"] = timeline.to_json() if timeline is not None else None
        run.config.update(config, allow_val_change=True)
    except Exception as exc:
        _warn(f"W&B did not start ({_masked(first_line(exc))}); logging to W&B is off, the other loggers go on.")
        return None
    if run.resumed:  # the server knows the run's last step even when trackers.json does not
        last = max(last, run.starting_step - 1)
    return TrackerRun(
        "wandb",
        "W&B",
        run.id,
        timeline_id,
        last,
        send=lambda step, metrics: run.log(metrics, step=step),
        finish=lambda complete: run.finish(exit_code=0 if complete else 1),
        where=where,
    )


def _start_mlflow(cfg, timeline, entry) -> TrackerRun | None:
    """The MLflow run of this timeline: the one trackers.json names, else the experiment's run tagged
    with the timeline, else a new one. A missing package, URI or server is one warning line and the
    run goes on without MLflow."""
    tc = cfg.trainer
    uri = tc.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
    if not uri:
        _warn(
            "trainer.loggers has mlflow but no tracking URI: set trainer.mlflow_tracking_uri, or pass "
            "MLFLOW_TRACKING_URI with `cloudrl submit --env MLFLOW_TRACKING_URI`. Logging to MLflow is off."
        )
        return None
    shown = _masked(uri)
    try:
        from mlflow.entities import Metric, Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient
    except ImportError:
        _warn(
            "trainer.loggers has mlflow but the mlflow package is missing (pip install mlflow-skinny); "
            "logging to MLflow is off."
        )
        return None
    down = _unreachable(uri)
    if down:
        _warn(f"cannot reach the MLflow server at {shown} ({down}); logging to MLflow is off, the other loggers go on.")
        return None
    timeline_id = timeline.run_id if timeline is not None else None
    try:
        client = MlflowClient(tracking_uri=uri)
        name = tc.mlflow_experiment or "cloudrl"
        found = client.get_experiment_by_name(name)
        experiment = found.experiment_id if found is not None else client.create_experiment(name)
        run_id, last = continued(entry, timeline_id, {"experiment": experiment})
        if run_id is not None:
            try:
                run = client.get_run(run_id)
            except MlflowException:  # deleted since, or another store under the same name
                run = None
            if run is None or run.info.experiment_id != experiment or run.info.lifecycle_stage != "active":
                run_id, last = None, -1
        if run_id is None and timeline_id is not None:
            tagged = f"tags.`cloudrl.timeline` = '{timeline_id}' and attributes.status != 'DELETED'"
            runs = client.search_runs([experiment], filter_string=tagged, max_results=1)
            if runs:
                run_id, last = runs[0].info.run_id, _mlflow_last_step(client, runs[0])
        if run_id is None:
            tags = {"cloudrl.timeline": timeline_id or "", "cloudrl.run_dir": str(Path(tc.run_dir).resolve())}
            if timeline is not None and timeline.parent:
                tags["cloudrl.branched_from"] = f"{timeline.parent.get('run_id')}@{timeline.parent.get('step')}"
            run_id = client.create_run(experiment, run_name=Path(tc.run_dir).name, tags=tags).info.run_id
        else:
            client.update_run(run_id, status="RUNNING")
        _mlflow_params(client, run_id, cfg, Param)
    except Exception as exc:
        _warn(
            f"MLflow at {shown} failed ({_masked(first_line(exc))}); logging to MLflow is off, the other loggers go on."
        )
        return None

    def send(step: int, metrics: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        batch = [Metric(_mlflow_key(k), v, now, step) for k, v in metrics.items() if math.isfinite(v)]
        if batch:
            client.log_batch(run_id, metrics=batch)

    return TrackerRun(
        "mlflow",
        "MLflow",
        run_id,
        timeline_id,
        last,
        send=send,
        finish=lambda complete: client.set_terminated(run_id, "FINISHED" if complete else "KILLED"),
        where={"experiment": experiment},
    )


def _mlflow_params(client, run_id: str, cfg, param) -> None:
    """The flattened config as the run's params. A resumed run keeps the values it started with (MLflow
    params never change): only new keys are added, and the changed ones are named in one line."""
    params = {}
    for k, v in flatten(without_secrets(cfg.to_dict())).items():
        params[k] = (v if isinstance(v, str) else json.dumps(v))[:MLFLOW_PARAM_CHARS]
    have = client.get_run(run_id).data.params
    new = [param(k, v) for k, v in params.items() if k not in have]
    if new:
        client.log_batch(run_id, params=new)
    changed = sorted(k for k, v in params.items() if k in have and have[k] != v)
    if changed:
        print(
            f"metrics: the MLflow run keeps the params it started with; changed since: {', '.join(changed)} "
            "(run_dir/config.yaml holds this run's)",
            flush=True,
        )


def _mlflow_last_step(client, run) -> int:
    """The last step a run holds, from its metric histories (trackers.json lost: a new disk)."""
    steps = [m.step for key in run.data.metrics for m in client.get_metric_history(run.info.run_id, key)]
    return max(steps, default=-1)


def _mlflow_key(name: str) -> str:
    """A metric name MLflow takes (letters, digits, _ - . / and space); a validation set's name may hold others."""
    return re.sub(r"[^\w\-. /]", "_", name)


def _unreachable(uri: str, timeout_s: float = 5.0) -> str:
    """Why the MLflow server at an http(s) `uri` takes no connection ("" when it does, or when `uri` is no
    server or a proxy stands between): checked once with a short timeout, so a server that is down costs
    one line at the start, not the minutes of MLflow's retries."""
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return ""
    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy")):
        return ""
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        socket.create_connection((parts.hostname, port), timeout=timeout_s).close()
    except ValueError:
        return "the URI's port is not a number"
    except OSError as exc:
        return exc.strerror or str(exc) or type(exc).__name__
    return ""


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


SAMPLE_EVERY = 50


def print_sample(step: int, prompt: str, tokenizer, response_ids: list[int], reward: float) -> None:
    """On step 1 and every SAMPLE_EVERY steps after, one sampled prompt, its response and its reward,
    so the job log shows what the model is asked and says, not only averages. The response is decoded
    only on those steps: the training step pays nothing otherwise."""
    if step % SAMPLE_EVERY == 1 or SAMPLE_EVERY == 1:
        response = tokenizer.decode(response_ids, skip_special_tokens=True)
        print(f"sample: prompt {prompt[-200:]!r} -> response {response[:200]!r}, reward {reward:.4g}", flush=True)


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
