"""W&B and MLflow ("trackers"): one tracker run per timeline of the run_dir.

Resumes and restarts that continue the timeline (state/timeline.py's run id) continue its tracker run, a new
timeline (a fresh start, a resume from a chosen checkpoint) starts a new one. A tracker run holds each step
once: steps a restart runs again (logged before the loss, after the checkpoint it resumes from) keep their
first values there. `run_dir/trackers.json` records, per tracker, its run and the last step it holds. A tracker
that cannot start or fails later is turned off with one line; the other loggers go on. Secrets never reach a
tracker: config values under secret-looking names and URL credentials are masked (`without_secrets`).
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


def current_timeline_of(run_dir: str):
    """The timeline this run logs (timeline.py decided it before the run started); None outside a run."""
    from .state.timeline import current_timeline

    return current_timeline(run_dir)


def start_wandb(cfg, timeline, entry) -> TrackerRun | None:
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


def start_mlflow(cfg, timeline, entry) -> TrackerRun | None:
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
