"""`cloudrl submit`: check, then ship the trainer to a Ray cluster as a job.

Order matters: everything that can fail is checked before anything is uploaded, so a failed submit
leaves nothing on the cluster. Offline first (the config, the --env names, and the trainer's own check of
the reward function and environment the config names, imported from the files as the job will have
them: `check_code`), then the cluster in a few
seconds (its dashboard answers, its Ray version equals ours, its alive nodes hold what the config
asks for), then the upload and the job. A connection that fails while the job is being created is asked
again for a bounded time (the submission id makes a job an earlier try created the one submitted); past
the bound, it is the one failure that can leave a job: `submit` looks for it and removes it, or says it
could not.

The cluster has no cloudrl installed: the installed `cloudrl.trainer` package is copied into a temp
`cloudrl/` directory and sent as a runtime-env `py_modules` entry, which Ray unpacks on each node
and puts on the job's PYTHONPATH ahead of site-packages. The local files the config names (reward
code, data, small models) and `--workdir` travel as the job's working directory (see shipping.py).

`--env` values never enter the runtime env: Ray keeps `runtime_env.env_vars` in its job table (the Jobs
API and dashboard show it) and writes it to runtime_env_agent.log on every node, which its log API
serves. They travel inside the package instead, as `cloudrl/job_env.json` (mode 0600, with a random
nonce so every submission is a package of its own), and the package's `cloudrl/__init__.py` puts them
into the environment of every process of the job when it first imports cloudrl, before any trainer code
runs: the driver, and the workers on every node (a gated model is downloaded on each node with HF_TOKEN).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import CloudrlError
from .ray_api import Address, ClusterClient, connection_reason, refusal, server_side
from .shipping import Upload, write_zip

# `python3` is what tasks/ray-bootstrap.sh installs Ray into; the local cluster puts this
# environment's python3 first on its nodes' PATH.
TRAINER_COMMAND = ["python3", "-m", "cloudrl.trainer"]
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass
class JobRequest:
    """Everything `submit_job` gets, minus the staged code directory and the secret values."""

    submission_id: str
    preset: str
    overrides: list[str]
    env_names: list[str] = field(default_factory=list)
    preset_file: Path | None = None
    """A preset given as a YAML path: shipped inside the package under its stem."""
    upload: Upload = field(default_factory=Upload)
    """The job's working directory: the local files the config names, and --workdir."""

    @property
    def preset_arg(self) -> str:
        """What the trainer gets as --preset: a name in the shipped package's presets/."""
        return self.preset_file.stem if self.preset_file else Path(self.preset).stem

    @property
    def entrypoint(self) -> str:
        # The upload's rewrites come last, so they win over the same keys in the user's overrides.
        return shlex.join(TRAINER_COMMAND + ["--preset", self.preset_arg] + self.overrides + self.upload.overrides)

    @property
    def metadata(self) -> dict[str, str]:
        # Ray keeps job metadata as strings; `cloudrl list` and `status` read these back.
        return {
            "cloudrl_preset": self.preset,
            "cloudrl_overrides": shlex.join(self.overrides),
            "cloudrl_name": self.submission_id,
        }

    def runtime_env(self, package_dir: str | Path, working_dir: str | Path | None = None) -> dict[str, Any]:
        """Ray's runtime env for the job. No --env value ever goes here (see the module docstring)."""
        # Unbuffered, so the step lines reach `cloudrl logs --follow` as they are printed.
        env: dict[str, Any] = {"py_modules": [str(package_dir)], "env_vars": {"PYTHONUNBUFFERED": "1"}}
        if working_dir is not None:
            env["working_dir"] = str(working_dir)
        if self.upload.pip:
            env["pip"] = {"packages": list(self.upload.pip), "pip_check": False}
        return env


def load_config(preset: str, overrides: list[str]) -> Any:
    """The trainer's own config check, its message turned into the CLI's one error type."""
    from cloudrl.trainer.config import ConfigError
    from cloudrl.trainer.config import load_config as trainer_load_config

    try:
        return trainer_load_config(preset, overrides)
    except ConfigError as exc:
        raise CloudrlError(str(exc)) from None


def build_request(
    preset: str, overrides: list[str], name: str | None, env_names: list[str], upload: Upload | None = None
) -> JobRequest:
    from cloudrl.trainer.config import PRESET_DIR, preset_path

    path = preset_path(preset)  # load_config has already accepted it
    preset_file = None if path.parent.resolve() == PRESET_DIR.resolve() else path
    if name is None:
        stem = re.sub(r"[^A-Za-z0-9_-]", "-", Path(preset).stem)[:40]
        name = f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    elif not NAME_RE.match(name):
        raise CloudrlError(f"--name {name!r}: use letters, digits, '.', '_' and '-' (it becomes the job id)")
    for env in env_names:
        if not ENV_RE.match(env):
            var = env.split("=")[0] or "NAME"
            raise CloudrlError(
                f"--env {env!r}: give the variable's NAME; its value is read from this shell and "
                f"never put on a command line (export {var}=... and pass --env {var})"
            )
    return JobRequest(name, preset, list(overrides), list(dict.fromkeys(env_names)), preset_file, upload or Upload())


def check_code(cfg: Any, upload: Upload, cwd: Path) -> str | None:
    """The trainer's check of the code the config names (`reward.function`, `rollout.environment`:
    cloudrl.trainer.inputs.checks.check_user_code), run here as the job will run it: on the upload's files laid out
    as the job's working directory (links to the files here), with the config's paths as the upload
    rewrites them, that directory the current one and first on sys.path. Its one line names the files
    as the config here does. A module this machine lacks is left to the cluster (it may be installed
    there, or come with --pip), and so is a file given as a path on the cluster: returns a note on it."""
    import copy

    from cloudrl.trainer.errors import TrainerError
    from cloudrl.trainer.inputs.checks import check_user_code

    job_cfg = copy.deepcopy(cfg)
    for key, value in upload.rewrites.items():
        section, name = key.split(".")
        setattr(getattr(job_cfg, section), name, value)
    on_cluster = [entry for entry in upload.cluster_paths if entry.startswith(CODE_KEYS)]
    for entry in on_cluster:  # only the cluster has it: it is checked there
        if entry.startswith("reward.function:"):
            job_cfg.reward.function = "none"
        else:
            job_cfg.rollout.environment = ""
    with tempfile.TemporaryDirectory(prefix="cloudrl-check-") as tmp:
        root = Path(tmp)
        for dest, src in upload.files.items():
            (root / dest).parent.mkdir(parents=True, exist_ok=True)
            (root / dest).symlink_to(src)
        here, path = os.getcwd(), list(sys.path)
        os.chdir(root)
        sys.path.insert(0, str(root))
        try:
            check_user_code(job_cfg)
        except TrainerError as exc:
            missing = _missing_module(exc)
            if missing is not None:
                return (
                    f"note: {missing}: not installed here, so the code the config names is checked on the "
                    f"cluster when the job starts"
                )
            raise CloudrlError(_as_here(str(exc), cfg, upload, root, cwd)) from None
        finally:
            os.chdir(here)
            sys.path[:] = path  # the trainer's loader leaves a user file's folder on sys.path
            for name, module in list(sys.modules.items()):  # a module:Class import, cached from the links
                if str(getattr(module, "__file__", None) or "").startswith(str(root)):
                    del sys.modules[name]
    if on_cluster:
        return f"note: {', '.join(on_cluster)}: a path on the cluster, checked there when the job starts"
    return None


CODE_KEYS = ("reward.function:", "rollout.environment:")


def _missing_module(exc: BaseException) -> str | None:
    """The module an import behind `exc` did not find here, as 'module NAME' (None: nothing missing)."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, ImportError):
            return f"module {cause.name!r}" if cause.name else "a module"
        cause = cause.__cause__ or cause.__context__
    return None


def _as_here(message: str, cfg: Any, upload: Upload, root: Path, cwd: Path) -> str:
    """The trainer's message with the upload's paths turned back into the ones the config names here."""
    pairs = [(str(root / dest), str(src)) for dest, src in upload.files.items()]
    for key, new in upload.rewrites.items():
        if f"{key}:" not in CODE_KEYS:
            continue
        section, name = key.split(".")
        old = str(getattr(getattr(cfg, section), name))
        pairs += [(new, old), (new.rpartition(":")[0], old.rpartition(":")[0])]
    pairs.append((str(root), str(cwd)))
    for shipped, local in sorted((p for p in pairs if p[0]), key=lambda p: -len(p[0])):
        message = message.replace(shipped, local)
    return message


def env_notes(cfg: Any, env_names: list[str]) -> str:
    """A note for each variable the config has the job read (a key, a token) that no --env passes: the job
    then finds it only if the cluster's nodes have it in their own environment."""
    named = [
        ("trainer.checkpoint_key_env", cfg.trainer.checkpoint_key_env),
        ("reward.url_token_env", cfg.reward.url_token_env),
    ]
    return "\n".join(
        f"note: {key}={name} is not passed with --env {name}: the job reads it from the cluster nodes' own "
        f"environment, and the run fails if they lack it"
        for key, name in named
        if name and name not in env_names
    )


def read_env(names: list[str]) -> dict[str, str]:
    missing = [n for n in names if n not in os.environ]
    if missing:
        raise CloudrlError(
            f"--env {', '.join(missing)}: not set in this shell; export {'them' if len(missing) > 1 else 'it'} "
            f"first or drop the --env"
        )
    return {n: os.environ[n] for n in names}


JOB_ENV_FILE = "job_env.json"
PACKAGE_INIT = '''"""cloudrl as `cloudrl submit` shipped it with one job.

The job's --env values are in job_env.json beside this file (never in Ray's runtime env, which Ray
shows in its job table and logs): every process of the job takes them into its environment here,
the first time it imports cloudrl.
"""

import json as _json
import os as _os

try:
    with open(_os.path.join(_os.path.dirname(__file__), "job_env.json"), encoding="utf-8") as _f:
        _os.environ.update(_json.load(_f)["env"])
except FileNotFoundError:
    pass
'''
"""The shipped package's __init__.py: a regular package, so the shipped copy wins over any cloudrl
installed on a node, which also loads the job's --env values."""


def stage_package(dest: Path, preset_file: Path | None = None, env_values: dict[str, str] | None = None) -> Path:
    """Copy the installed `cloudrl.trainer` into dest/cloudrl/trainer, with the --env values in
    dest/cloudrl/job_env.json (0600); returns dest/cloudrl."""
    import cloudrl.trainer

    source = Path(cloudrl.trainer.__file__).parent
    package = dest / "cloudrl"
    shutil.copytree(source, package / "trainer", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (package / "__init__.py").write_text(PACKAGE_INIT)
    if env_values:
        # Created 0600 (Ray keeps file modes when it unpacks the package on a node). The nonce makes
        # every submission's package distinct, so no two jobs ever share one unpacked copy of it.
        fd = os.open(package / JOB_ENV_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"nonce": secrets.token_hex(16), "env": env_values}, f)
    if preset_file is not None:
        shutil.copyfile(preset_file, package / "trainer" / "presets" / f"{preset_file.stem}.yaml")
    return package


def preflight(client: ClusterClient, cfg: Any) -> str:
    """The cluster answers, runs our Ray version, and can place every role of cfg; returns a summary."""
    from cloudrl.trainer.config import ConfigError
    from cloudrl.trainer.roles.placement import check_fits, describe_cluster, plan

    version = client.check_version()
    nodes = client.alive_nodes()
    try:
        check_fits(plan(cfg), nodes, local=is_local_cluster(client.address))
    except ConfigError as exc:
        raise CloudrlError(f"{exc} (cluster at {client.address.url})") from None
    return f"cluster ok: Ray {version}, {describe_cluster(nodes)}"


def is_local_cluster(address: Address) -> bool:
    """The address is the cluster `cloudrl local up` started (by --local, or by its URL)."""
    from .local_state import running_dashboard_url

    return address.source == "local" or address.url == running_dashboard_url()


def dry_run_text(cfg: Any, req: JobRequest, address: Address, zipped_bytes: int | None) -> str:
    import yaml

    placeholder = f"<a copy of cloudrl.trainer{' + ' + str(req.preset_file) if req.preset_file else ''}>"
    request: dict[str, Any] = {
        "address": address.url,
        "submission_id": req.submission_id,
        "entrypoint": req.entrypoint,
        "runtime_env": req.runtime_env(placeholder, "<the files below, zipped>" if req.upload.files else None),
        "metadata": req.metadata,
    }
    if req.env_names:
        request["env_in_package"] = {n: "<from this shell, not shown>" for n in req.env_names}
    files = (
        f"# files shipped as the job's working directory\n{req.upload.listing(zipped_bytes)}\n"
        if req.upload.files
        else "# files shipped: none besides the trainer (the config names no local file)\n"
    )
    if req.upload.excluded:
        files += f"# left out of the job's files (why)\n{req.upload.excluded_listing()}\n"
    if req.upload.cluster_paths:
        files += "# read on the cluster, not shipped (absolute paths not on this machine):\n"
        files += "".join(f"  {entry}\n" for entry in req.upload.cluster_paths)
    return (
        f"# resolved config ({req.preset}{' + ' + ' '.join(req.overrides) if req.overrides else ''})\n"
        f"{cfg.to_yaml()}\n{files}# job request (--dry-run: not submitted, the cluster was not contacted)\n"
        f"{yaml.safe_dump(request, sort_keys=False)}"
    )


def pack_upload(req: JobRequest, tmp: Path) -> tuple[Path | None, int | None]:
    """The job's working directory as a zip in tmp (None when nothing is shipped), and its size.
    Raises before anything is sent when the zip is over Ray's upload limit."""
    if not req.upload.files:
        return None, None
    target = tmp / "job-files.zip"
    return target, write_zip(req.upload, target)


SUBMIT_RETRY_S = 30.0
"""How long `submit` keeps asking while the cluster answers with a failure of its own (HTTP 500: on a cluster
that has just come up, its job agent may not listen yet) or the connection fails (refused, reset, closed
without a reply); past it, the error names the cause."""
SUBMIT_RETRY_EVERY_S = 3.0


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def submit(
    client: ClusterClient,
    req: JobRequest,
    env_values: dict[str, str],
    files_zip: Path | None = None,
    echo: Callable[[str], None] = _stderr,
) -> str:
    """Upload the trainer (and the job's files) and create the job. When the connection fails (or Ctrl+C
    comes) after the request left, the job may exist anyway: it is removed, or the error says it may not be."""
    import requests

    jobs = client.jobs
    with tempfile.TemporaryDirectory(prefix="cloudrl-submit-") as tmp:
        package = stage_package(Path(tmp), req.preset_file, env_values)
        try:
            return _create_job(jobs, req, req.runtime_env(package, files_zip), client.address.url, echo)
        except (requests.exceptions.RequestException, KeyboardInterrupt) as exc:
            # The request may have reached the cluster before the connection broke: the job can exist
            # although we never saw its id come back. Look for it and remove it before saying anything.
            removed = _remove_job(jobs, req.submission_id)
            if isinstance(exc, KeyboardInterrupt):
                raise
            failed = f"submitting to {client.address.url} failed ({type(exc).__name__}: {connection_reason(exc)})"
            if removed:
                raise CloudrlError(f"{failed}; no job was left behind: check the connection and submit again") from None
            flag = client.address.flag
            raise CloudrlError(
                f"{failed}, and whether job {req.submission_id!r} was created could not be confirmed: "
                f"run `cloudrl list{flag}` and `cloudrl stop {req.submission_id}{flag}`"
            ) from None


def _create_job(jobs: Any, req: JobRequest, runtime_env: dict[str, Any], url: str, echo: Callable[[str], None]) -> str:
    """One job created under `req.submission_id`, asking again (up to SUBMIT_RETRY_S) while the cluster fails
    on its side or the connection fails. A name that exists is refused on the first try; on a later one, it
    is the job an earlier try created before its answer was lost, so it is that job's id. A read timeout is
    not asked again: the request may still be running, and it has already had SUBMIT_READ_TIMEOUT_S."""
    import requests

    deadline = time.monotonic() + SUBMIT_RETRY_S
    tries = 0
    while True:
        tries += 1
        try:
            return jobs.submit_job(
                entrypoint=req.entrypoint,
                submission_id=req.submission_id,
                runtime_env=runtime_env,
                metadata=req.metadata,
            )
        except requests.exceptions.ConnectionError as exc:  # refused, reset, closed unanswered: may pass
            if time.monotonic() + SUBMIT_RETRY_EVERY_S > deadline:
                raise
            if tries == 1:
                echo(
                    f"the connection to {url} failed ({connection_reason(exc)}); asking again for up to {SUBMIT_RETRY_S:g} s"
                )
        except RuntimeError as exc:  # the Jobs API said no
            text = str(exc)
            if "already" in text and req.submission_id in text:
                if tries > 1:
                    return req.submission_id
                raise CloudrlError(
                    f"a job named {req.submission_id!r} already exists on {url}: pick another --name"
                ) from None
            if not server_side(text) or time.monotonic() + SUBMIT_RETRY_EVERY_S > deadline:
                tried = f" (asked {tries} times over {SUBMIT_RETRY_S:g} s)" if tries > 1 else ""
                raise CloudrlError(f"the cluster refused the job{tried}: {refusal(text)}") from None
            if tries == 1:
                echo(f"the cluster failed on its side ({refusal(text)}); asking again for up to {SUBMIT_RETRY_S:g} s")
        time.sleep(SUBMIT_RETRY_EVERY_S)


REMOVE_TIMEOUT_S = 30.0
"""How long a failed submit waits, after stopping the job it may have created, for that job to end;
past it, the error says the removal could not be confirmed rather than wait on."""


def _remove_job(client: Any, submission_id: str) -> bool:
    """Whether `submission_id` is confirmed absent from the cluster: it never existed, or it was stopped,
    reached a terminal state and was deleted. False when the cluster cannot tell us (or will not stop it)."""
    try:
        if not _job_exists(client, submission_id):
            return True
        client.stop_job(submission_id)  # False (not an error) when it has already ended
        deadline = time.monotonic() + REMOVE_TIMEOUT_S
        while not client.get_job_status(submission_id).is_terminal():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)
        client.delete_job(submission_id)
        # A job stopped while it was still being set up can be written back by its supervisor a moment
        # later: it counts as gone only when it stays gone.
        for _ in range(3):
            time.sleep(1.0)
            if _job_exists(client, submission_id):
                client.stop_job(submission_id)
                client.delete_job(submission_id)
        return not _job_exists(client, submission_id)
    except Exception:  # the cluster went away mid-way (or answered something unexpected): unconfirmed
        return False


def _job_exists(client: Any, submission_id: str) -> bool:
    """Ask the Jobs API for the job; raises when the cluster does not answer, so unknown is never "no"."""
    try:
        client.get_job_info(submission_id)
    except RuntimeError as exc:  # Ray's client turns every HTTP error status into this
        if "status code 404" in str(exc):
            return False
        raise
    return True


def next_steps(address: Address, job_id: str) -> str:
    flag = address.flag
    return (
        f"dashboard:   {address.job_url(job_id)}\n"
        f"follow logs: cloudrl logs {job_id} --follow{flag}\n"
        f"status:      cloudrl status {job_id}{flag}\n"
        f"stop:        cloudrl stop {job_id}{flag}"
    )
