"""The `cloudrl` command: submit the trainer to a Ray cluster and watch it from this machine.

Commands stay thin: parse, call one function of their module, print. Expected failures are
TrainerErrors (CloudrlError, ClusterUnreachable, the trainer's config errors); the command group
(`typer_compat.OneLineErrors`) prints them as one red line on stderr and exits 1 (CLOUDRL_DEBUG=1 shows
the CLI's own traceback instead; a job's traceback is in its log when it ran with `--env CLOUDRL_DEBUG`). Usage errors (an unknown option, a missing argument, a value click cannot
parse) are one red line too, naming the command's --help, with click's exit status 2. Ray and dstack
are imported inside the modules' functions, so `cloudrl --help` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from .pins import DASHBOARD_PORT
from .typer_compat import OneLineErrors
from .validate import validate as _validate

app = typer.Typer(
    cls=OneLineErrors,
    no_args_is_help=True,
    help="Run cloudrl's PPO trainer on a Ray cluster (dstack, Slurm, or this machine) and watch it.",
    # Locals in a traceback could show secrets passed with --env.
    pretty_exceptions_show_locals=False,
)
local_app = typer.Typer(
    cls=OneLineErrors,
    no_args_is_help=True,
    help="A Ray cluster on this machine (127.0.0.1), for the whole flow without a cloud.",
)
app.add_typer(local_app, name="local")


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"cloudrl {version('cloudrl')}")
        except PackageNotFoundError:  # run from a checkout that was never installed
            typer.echo("cloudrl (not installed: no version; pip install -e . gives it one)")
        raise typer.Exit()


@app.callback()
def _options(
    show_version: Annotated[
        bool,
        typer.Option("--version", is_eager=True, callback=_print_version, help="Print cloudrl's version and exit."),
    ] = False,
) -> None:
    """Run cloudrl's PPO trainer on a Ray cluster (dstack, Slurm, or this machine) and watch it."""


AddressOpt = Annotated[
    str | None,
    typer.Option(
        "--address",
        "-a",
        show_default=False,
        help=f"The Ray dashboard's URL. Default: $RAY_ADDRESS, else http://127.0.0.1:{DASHBOARD_PORT} "
        "(where `dstack apply` and `cloudrl dashboard` forward it).",
    ),
]
LocalOpt = Annotated[bool, typer.Option("--local", help="Use the cluster `cloudrl local up` started.")]
InsecureOpt = Annotated[
    bool,
    typer.Option(
        "--insecure-http",
        help="Send the Ray token over plain http:// to a host other than this machine (anyone on the path "
        "can read it). Default: refused; forward the dashboard with `cloudrl dashboard` or use https://.",
    ),
]
JobArg = Annotated[
    str, typer.Argument(help="The job id `cloudrl submit` printed (see `cloudrl list`).", show_default=False)
]


def _client(address: str | None, local: bool, insecure_http: bool = False) -> Any:
    from .ray_api import ClusterClient, resolve_address

    return ClusterClient(resolve_address(address, local), insecure_http=insecure_http)


def _follow(client: Any, job_id: str, watch: Any = None) -> None:
    """Follow a job to its end (`watch()` instead of plain `follow` when given); exit 130 on Ctrl+C."""
    from .jobs import Detached, follow

    try:
        info = watch() if watch else follow(client, job_id)
    except Detached as exc:
        job_id = str(exc.args[0]) if exc.args else job_id
        typer.echo(
            f"\ndetached from {job_id}; it keeps running. Stop it with: cloudrl stop {job_id}{client.address.flag}",
            err=True,
        )
        raise typer.Exit(130) from None
    typer.echo(f"job {getattr(info, 'submission_id', None) or job_id} {info.status}")


# ----------------------------------------------------------------------------------------------
# submit
# ----------------------------------------------------------------------------------------------


@app.command(epilog="Example: cloudrl submit --local trainer.total_steps=5 --follow")
def submit(
    overrides: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="[KEY=VALUE]...",
            show_default=False,
            help="Config overrides, e.g. actor.lr=1e-6 algorithm.name=grpo (checked before anything is sent).",
        ),
    ] = None,
    preset: Annotated[
        str, typer.Option("--preset", "-p", help="Preset name from trainer/presets, or a path to your own YAML preset.")
    ] = "local",
    address: AddressOpt = None,
    local: Annotated[
        bool,
        typer.Option(
            "--local", help="Submit to the cluster on this machine; starts one (`cloudrl local up`) if none runs."
        ),
    ] = False,
    follow: Annotated[
        bool,
        typer.Option(
            "--follow",
            "-f",
            help="Stream the logs until the job ends; exit 0 only if it succeeded. "
            "Ctrl+C detaches and leaves the job running.",
        ),
    ] = False,
    name: Annotated[
        str | None,
        typer.Option(
            "--name",
            "-n",
            show_default=False,
            help="Job id to use (letters, digits, . _ -). Default: PRESET-DATE-TIME-XXXX.",
        ),
    ] = None,
    env: Annotated[
        list[str] | None,
        typer.Option(
            "--env",
            "-e",
            show_default=False,
            help="Name of a variable of this shell to pass to the job (repeatable); its value is never printed, "
            "and travels inside the job's package, never in Ray's job table or logs.",
        ),
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Print the resolved config, every file that would be uploaded with its size, and "
            "the job request; contact no cluster.",
        ),
    ] = False,
    workdir: Annotated[
        Path | None,
        typer.Option(
            "--workdir",
            "-w",
            show_default=False,
            file_okay=False,
            help="Also ship this directory's tree (your own code) as the job's working directory: in a git work "
            "tree what `git ls-files` lists, else what its .gitignore files leave; never .cloudrlignore patterns, "
            "credential files (.env, .aws/, .ssh/, *.pem) or links out of the tree (--dry-run lists them).",
        ),
    ] = None,
    requirements: Annotated[
        Path | None,
        typer.Option(
            "--requirements",
            "-r",
            show_default=False,
            dir_okay=False,
            help="A requirements.txt whose packages Ray installs for the job on every node.",
        ),
    ] = None,
    pip: Annotated[
        list[str] | None,
        typer.Option(
            "--pip", show_default=False, help="A package Ray installs for the job on every node (repeatable)."
        ),
    ] = None,
    reconnect_wait: Annotated[
        float,
        typer.Option(
            "--reconnect-wait",
            min=0,
            metavar="SECONDS",
            help="With --follow: when the cluster stops answering, wait this long for it to come back, then follow "
            "the job again or, on a restarted cluster, submit it again to continue from its latest "
            "checkpoint (0: fail at once).",
        ),
    ] = 1800,
    insecure_http: InsecureOpt = False,
    gpu_memory_gib: Annotated[
        float,
        typer.Option(
            "--gpu-memory-gib",
            min=1,
            help="Memory of one GPU of the cluster, in GiB: a run on GPUs whose memory plan (`cloudrl plan`) "
            "does not fit it is refused before anything is sent.",
        ),
    ] = 80.0,
) -> None:
    """Check the config and the cluster in seconds, then run the trainer there as a Ray job.

    The local files the config names (a reward.function file, data files, a local model directory) are
    shipped with the job, and the config is pointed at them. Prints the job id, its dashboard URL and
    the commands to follow, inspect and stop it.
    """
    import tempfile

    from . import submit as sub
    from .plan import check_memory
    from .ray_api import Address, resolve_address
    from .shipping import plan_upload

    overrides = overrides or []
    cfg = sub.load_config(preset, overrides)
    upload = plan_upload(cfg, Path.cwd(), workdir, requirements, pip)
    note = sub.check_code(cfg, upload, Path.cwd())  # the trainer's check of reward.function, rollout.environment
    if note:
        typer.echo(note, err=True)
    note = check_memory(cfg, gpu_memory_gib)  # a run on GPUs: its memory plan, before any node is contacted
    if note:
        typer.echo(note, err=True)
    req = sub.build_request(preset, overrides, name, env or [], upload)
    env_values = sub.read_env(req.env_names)
    note = sub.env_notes(cfg, req.env_names)
    if note:
        typer.echo(note, err=True)
    with tempfile.TemporaryDirectory(prefix="cloudrl-files-") as tmp:
        files_zip, zipped = sub.pack_upload(req, Path(tmp))
        if dry_run:
            where = Address("(the local cluster)", "local") if local else resolve_address(address)
            typer.echo(sub.dry_run_text(cfg, req, where, zipped), nl=False)
            return
        _submit(sub, cfg, req, env_values, (files_zip, zipped), address, local, follow, reconnect_wait, insecure_http)


def _start_local_cluster() -> None:
    from . import local_cluster

    typer.echo("no local cluster is running: starting one (as `cloudrl local up` would)")
    state = local_cluster.up(echo=typer.echo)
    typer.echo(
        f"local cluster up: {state['num_nodes']} node(s) x {state['cpus_per_node']} CPUs, "
        f"dashboard {state['dashboard_url']}; stop it with `cloudrl local down`"
    )


def _submit(
    sub: Any,
    cfg: Any,
    req: Any,
    env_values: dict,
    files: tuple,
    address: str | None,
    local: bool,
    follow: bool,
    reconnect_wait: float,
    insecure_http: bool = False,
) -> None:
    """The cluster half of `submit`: start the local cluster if asked, preflight, send, follow (through a
    cluster restart, waiting up to `reconnect_wait` seconds for it to answer again)."""
    from .ray_api import ClusterClient, resolve_address

    files_zip, zipped = files
    client = ClusterClient(
        resolve_address(address, local, start_local=_start_local_cluster), insecure_http=insecure_http
    )
    typer.echo(sub.preflight(client, cfg))
    if files_zip is not None:
        typer.echo(
            f"shipping {len(req.upload.files)} file(s) ({zipped / 1024**2:.1f} MiB zipped) as the job's "
            f"working directory"
        )
    job_id = sub.submit(client, req, env_values, files_zip)
    typer.echo(f"submitted {job_id} to {client.address.url}")
    typer.echo(sub.next_steps(client.address, job_id))
    if follow:
        from .watch import follow_through_restarts, resubmitter

        typer.echo("")
        resubmit = resubmitter(sub, req, env_values, files_zip)
        _follow(client, job_id, lambda: follow_through_restarts(client, job_id, resubmit, reconnect_wait, typer.echo))


@app.command(
    epilog="Examples: cloudrl plan --preset gsm8k-7b    |    cloudrl plan -p gsm8k-7b actor.fsdp=false    |    "
    "dstack offer --gpu 8 --json > offers.json && cloudrl plan -p gsm8k-7b --offers offers.json --max-price 60"
)
def plan(
    overrides: Annotated[
        list[str] | None,
        typer.Argument(metavar="[KEY=VALUE]...", show_default=False, help="Config overrides, as for submit."),
    ] = None,
    preset: Annotated[
        str, typer.Option("--preset", "-p", help="Preset name from trainer/presets, or a path to your own YAML preset.")
    ] = "local",
    gpu_memory_gib: Annotated[
        float, typer.Option("--gpu-memory-gib", metavar="GIB", help="Memory of one GPU (80: H100/A100 80GB).")
    ] = 80.0,
    offers: Annotated[
        str,
        typer.Option(
            "--offers",
            metavar="FILE",
            show_default=False,
            help="`dstack offer --json` output (`-`: stdin): list the offers the config fits on, cheapest first.",
        ),
    ] = "",
    max_price: Annotated[
        float, typer.Option("--max-price", metavar="USD", help="With --offers: the most per hour of all nodes.")
    ] = 0.0,
) -> None:
    """Print what each GPU of every role and engine holds, and its peak, from the model's config.json alone;
    exit 1 naming the keys that would make it fit when a role's GPUs cannot hold it. With --offers, list the
    dstack offers on which the plan fits and every role can be placed, with the nodes each needs."""
    from .offers import show_offers
    from .plan import show_plan

    if offers:
        show_offers(preset, overrides or [], offers, max_price, typer.echo)
    else:
        show_plan(preset, overrides or [], gpu_memory_gib, typer.echo)


# ----------------------------------------------------------------------------------------------
# jobs
# ----------------------------------------------------------------------------------------------


@app.command(epilog="Example: cloudrl status --local")
def status(
    job: Annotated[
        str | None, typer.Argument(help="Job id; default: the latest job on the cluster.", show_default=False)
    ] = None,
    address: AddressOpt = None,
    local: LocalOpt = False,
    insecure_http: InsecureOpt = False,
) -> None:
    """Show a job's status and the latest training metrics it logged."""
    from .jobs import status_text

    typer.echo(status_text(_client(address, local, insecure_http), job))


@app.command(
    epilog="Examples: cloudrl logs --follow; cloudrl logs local-20250101-120000-a1b2; cloudrl logs JOB --node 1"
)
def logs(
    job: Annotated[
        str | None,
        typer.Argument(
            help="Job id (see `cloudrl list`); default: the latest job on the cluster. With --node: only this "
            "job's worker logs.",
            show_default=False,
        ),
    ] = None,
    follow: Annotated[
        bool,
        typer.Option("--follow", "-f", help="Stream until the job ends; exit 0 only if it succeeded. Ctrl+C detaches."),
    ] = False,
    node: Annotated[
        str | None,
        typer.Option(
            "--node",
            metavar="N",
            show_default=False,
            help="Instead of a job's driver log: one node's Ray worker logs (of every job, or of JOB when given). "
            "N: 0 = the head, then by IP; or an IP or node id.",
        ),
    ] = None,
    lines: Annotated[int, typer.Option("--lines", help="With --node: the last lines of each file.")] = 50,
    glob: Annotated[str, typer.Option("--glob", help="With --node: which of Ray's log files.")] = "worker-*",
    address: AddressOpt = None,
    local: LocalOpt = False,
    insecure_http: InsecureOpt = False,
) -> None:
    """Print a job's logs (its driver's stdout and stderr), or with --node one node's worker logs."""
    from .jobs import job_logs, job_name, latest_job, safe_text
    from .node_logs import job_or_node, node_logs_text

    job_or_node(job, node, follow)
    client = _client(address, local, insecure_http)
    if node is not None:
        typer.echo(node_logs_text(client, node, lines, glob, job), nl=False)
        return
    if job is None:  # like `cloudrl status`: the latest job, named on stderr so the log itself stays clean
        job = job_name(latest_job(client))
        typer.echo(f"# logs of {job}, the latest job on {client.address.url}", err=True)
    if follow:
        _follow(client, job)
    else:
        typer.echo(safe_text(job_logs(client, job)), nl=False)


@app.command(epilog="Example: cloudrl stop local-20250101-120000-a1b2")
def stop(job: JobArg, address: AddressOpt = None, local: LocalOpt = False, insecure_http: InsecureOpt = False) -> None:
    """Stop a running job and wait until Ray reports it stopped."""
    from .jobs import stop as stop_job

    typer.echo(stop_job(_client(address, local, insecure_http), job))


@app.command("list", epilog=f"Example: cloudrl list --address http://127.0.0.1:{DASHBOARD_PORT}")
def list_(address: AddressOpt = None, local: LocalOpt = False, insecure_http: InsecureOpt = False) -> None:
    """List the cluster's jobs: id, status, start, duration and preset."""
    from .jobs import list_text

    typer.echo(list_text(_client(address, local, insecure_http)))


# ----------------------------------------------------------------------------------------------
# dashboard
# ----------------------------------------------------------------------------------------------


@app.command(epilog="Examples: cloudrl dashboard    |    cloudrl dashboard --ssh me@head-node")
def dashboard(
    run: Annotated[
        str | None,
        typer.Argument(
            help="dstack run name; default: the `name:` in tasks/ray-cluster.dstack.yml.", show_default=False
        ),
    ] = None,
    ssh: Annotated[
        str | None,
        typer.Option(
            "--ssh",
            metavar="HOST",
            show_default=False,
            help="Forward with plain ssh from this host (user@host, an ~/.ssh/config alias, or "
            "ssh://user@host:port) for clusters not made by dstack.",
        ),
    ] = None,
    port: Annotated[
        int | None,
        typer.Option(
            "--port",
            "-p",
            show_default=False,
            help=f"Local port on 127.0.0.1. Default: {DASHBOARD_PORT} if free, else any free port; 0 = any free port.",
        ),
    ] = None,
    remote_port: Annotated[
        int, typer.Option("--remote-port", help="The dashboard's port on the head node.")
    ] = DASHBOARD_PORT,
    ssh_option: Annotated[
        list[str] | None,
        typer.Option(
            "--ssh-option",
            "-o",
            metavar="KEY=VALUE",
            show_default=False,
            help="Extra ssh option (repeatable), e.g. -o IdentityFile=~/.ssh/cluster.",
        ),
    ] = None,
) -> None:
    """Forward a cluster's Ray dashboard to 127.0.0.1 and keep it up until Ctrl+C.

    A forward that `dstack apply` or `dstack attach` already holds is reused.
    """
    from .dashboard import run_dashboard

    run_dashboard(run, ssh, port, remote_port, ssh_option or [], typer.echo)


# ----------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------

from .data import RECIPES as _DATASETS  # noqa: E402  (stdlib-only module: the names for --help)


@app.command(
    "data",
    epilog="Examples: cloudrl data gsm8k --out data/gsm8k    |    "
    "cloudrl data gsm8k --out data/gsm8k --source ./gsm8k_saved",
)
def data_(
    name: Annotated[
        str,
        typer.Argument(
            show_default=False, help="The dataset: " + "; ".join(f"{k}: {r.about}" for k, r in _DATASETS.items())
        ),
    ],
    out: Annotated[
        str,
        typer.Option(
            "--out",
            "-o",
            show_default=False,
            help="Directory for train.parquet and test.parquet (created if missing); one the cluster can read.",
        ),
    ],
    source: Annotated[
        str | None,
        typer.Option(
            "--source",
            "-s",
            show_default=False,
            help="Read from here instead of the hub (offline): a directory written by save_to_disk, a directory of "
            "the dataset's Parquet files, or another hub id DATASET[:CONFIG].",
        ),
    ] = None,
) -> None:
    """Write a dataset as Parquet files in the trainer's layout (verl's columns), ready for data.train_files."""
    from .data import next_command, write_dataset

    written = write_dataset(name, out, source)
    for w in written:
        typer.echo(f"{w.split}: {w.rows} rows -> {w.path}")
    typer.echo(f"train on them: {next_command(name, written)}")


# ----------------------------------------------------------------------------------------------
# local cluster
# ----------------------------------------------------------------------------------------------


@local_app.command("up", epilog="Example: cloudrl local up --nodes 2")
def local_up(
    nodes: Annotated[int, typer.Option("--nodes", "-n", min=1, help="Ray nodes to start on 127.0.0.1.")] = 1,
    cpus: Annotated[
        int | None,
        typer.Option(
            "--cpus",
            min=1,
            show_default=False,
            help="Logical CPUs per node. Default: this machine's cores split over the nodes, at least 2 each "
            "and enough for the local preset.",
        ),
    ] = None,
    gpus: Annotated[
        int | None,
        typer.Option(
            "--gpus",
            min=0,
            show_default=False,
            help="GPUs per node. Default: detected with one node, 0 with several (Ray would count each GPU "
            "once per node).",
        ),
    ] = None,
    object_store_mb: Annotated[
        int, typer.Option("--object-store-mb", min=80, help="Ray object store per node, in MB.")
    ] = 512,
    dashboard_port: Annotated[
        int,
        typer.Option(
            "--dashboard-port",
            min=0,
            envvar="CLOUDRL_LOCAL_DASHBOARD_PORT",
            help="Dashboard port on 127.0.0.1; another free one if taken; 0 = any free port.",
        ),
    ] = DASHBOARD_PORT,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for all nodes to join.")] = 120.0,
    debugger: Annotated[
        str | None,
        typer.Option(
            "--debugger",
            show_default=False,
            metavar="legacy",
            help="Run the workers with Ray's pdb, so a breakpoint() in your reward (or in the trainer's workers) "
            "pauses there until you attach with `ray debug` (the command is printed here and in each job's log). "
            "Default: off (Ray skips a breakpoint() with a warning). docs/debugging.md.",
        ),
    ] = None,
) -> None:
    """Start a Ray cluster of N nodes on this machine and wait until every node has joined."""
    from . import local_cluster
    from .ray_api import check_port

    check_port("--dashboard-port", dashboard_port, zero_means_any=True)
    state = local_cluster.up(
        nodes, cpus, gpus, object_store_mb, dashboard_port, timeout, echo=typer.echo, debugger=debugger
    )
    typer.echo(
        f"local cluster up: {nodes} node(s) x {state['cpus_per_node']} CPUs, "
        f"dashboard {state['dashboard_url']}\n"
        f"token:   {state['token_file']} (Ray token auth: the CLI sends it to this cluster only; "
        f"the browser's dashboard asks for it)\n"
        f"submit:  cloudrl submit --local\n"
        f"stop it: cloudrl local down"
    )
    if state.get("debugger"):
        typer.echo(
            f"debugger: {state['debugger']}: a breakpoint() in a worker pauses it until you attach "
            f"(no token guards it: stop the cluster when done); attach with:\n  {state['debugger_attach']}"
        )


@local_app.command("down", epilog="Example: cloudrl local down")
def local_down() -> None:
    """Stop every process `cloudrl local up` started (and nothing else)."""
    from . import local_cluster

    local_cluster.down(echo=typer.echo)


# `cloudrl validate` lives with the bundle checks (cli/validate.py); it is registered here like the rest.
app.command("validate", epilog="Example: cloudrl validate   (in the checkout, before `dstack apply`)")(_validate)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
