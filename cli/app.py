"""The `cloudrl` command: submit the trainer to a Ray cluster and watch it from this machine.

Commands stay thin: parse, call one function of their module, print. Expected failures are
CloudrlError; the group below prints them as one red line on stderr and exits 1 (CLOUDRL_DEBUG=1
shows the traceback instead). Ray and dstack are imported inside the modules' functions, so
`cloudrl --help` stays fast.
"""

from __future__ import annotations

import os
from typing import Annotated, Any, Optional

import typer
from typer.core import TyperGroup

from .errors import CloudrlError


class _Group(TyperGroup):
    """Turns expected failures into one red line and exit status 1."""

    def invoke(self, ctx: typer.Context) -> Any:
        try:
            return super().invoke(ctx)
        except Exception as exc:
            from cloudrl.trainer.config import ConfigError

            if not isinstance(exc, (CloudrlError, ConfigError)) or os.environ.get("CLOUDRL_DEBUG"):
                raise
            typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
            raise typer.Exit(1) from None


app = typer.Typer(
    cls=_Group,
    no_args_is_help=True,
    help="Run cloudrl's PPO trainer on a Ray cluster (dstack, Slurm, or this machine) and watch it.",
    # Locals in a traceback could show secrets passed with --env.
    pretty_exceptions_show_locals=False,
)
local_app = typer.Typer(cls=_Group, no_args_is_help=True,
                        help="A Ray cluster on this machine (127.0.0.1), for the whole flow without a cloud.")
app.add_typer(local_app, name="local")

AddressOpt = Annotated[Optional[str], typer.Option(
    "--address", "-a", show_default=False,
    help="The Ray dashboard's URL. Default: $RAY_ADDRESS, else http://127.0.0.1:8265 (where `dstack apply` "
         "and `cloudrl dashboard` forward it).")]
LocalOpt = Annotated[bool, typer.Option("--local", help="Use the cluster `cloudrl local up` started.")]
JobArg = Annotated[str, typer.Argument(help="The job id `cloudrl submit` printed (see `cloudrl list`).",
                                       show_default=False)]


def _dashboard(address: str | None, local: bool) -> Any:
    from .ray_api import Dashboard, resolve_address

    return Dashboard(resolve_address(address, local))


def _follow(dash: Any, job_id: str) -> None:
    from .jobs import Detached, follow

    try:
        info = follow(dash, job_id)
    except Detached:
        typer.echo(f"\ndetached from {job_id}; it keeps running. Stop it with: cloudrl stop {job_id}"
                   f"{dash.address.flag}", err=True)
        raise typer.Exit(130) from None
    typer.echo(f"job {job_id} {info.status}")


# ----------------------------------------------------------------------------------------------
# submit
# ----------------------------------------------------------------------------------------------


@app.command(epilog="Example: cloudrl submit --local trainer.total_steps=5 --follow")
def submit(
    overrides: Annotated[Optional[list[str]], typer.Argument(
        metavar="[KEY=VALUE]...", show_default=False,
        help="Config overrides, e.g. actor.lr=1e-6 algorithm.name=grpo (checked before anything is sent).")] = None,
    config: Annotated[str, typer.Option(
        "--config", "-c", help="Preset name from trainer/presets, or a path to your own YAML preset.")] = "local",
    address: AddressOpt = None,
    local: Annotated[bool, typer.Option(
        "--local", help="Submit to the cluster on this machine; starts one (`cloudrl local up`) if none runs.")] = False,
    follow: Annotated[bool, typer.Option(
        "--follow", "-f", help="Stream the logs until the job ends; exit 0 only if it succeeded. "
                               "Ctrl+C detaches and leaves the job running.")] = False,
    name: Annotated[Optional[str], typer.Option(
        "--name", "-n", show_default=False,
        help="Job id to use (letters, digits, . _ -). Default: PRESET-DATE-TIME-XXXX.")] = None,
    env: Annotated[Optional[list[str]], typer.Option(
        "--env", "-e", show_default=False,
        help="Name of a variable of this shell to pass to the job (repeatable); its value is never printed.")] = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Print the resolved config and the job request; contact no cluster.")] = False,
) -> None:
    """Check the config and the cluster in seconds, then run the trainer there as a Ray job.

    Prints the job id, its dashboard URL and the commands to follow, inspect and stop it.
    """
    from . import submit as sub
    from .ray_api import Address, Dashboard, resolve_address

    overrides = overrides or []
    cfg = sub.load_config(config, overrides)
    req = sub.build_request(config, overrides, name, env or [])
    env_values = sub.read_env(req.env_names)
    if dry_run:
        where = Address("(the local cluster)", "local") if local else resolve_address(address)
        typer.echo(sub.dry_run_text(cfg, req, where), nl=False)
        return
    if local:
        from . import local_cluster

        if address:
            raise CloudrlError("pass either --local or --address, not both")
        if local_cluster.running_dashboard_url() is None:
            typer.echo("no local cluster is running: starting one (as `cloudrl local up` would)")
            state = local_cluster.up(echo=typer.echo)
            typer.echo(f"local cluster up: {state['num_nodes']} node(s) x {state['cpus_per_node']} CPUs, "
                       f"dashboard {state['dashboard_url']}; stop it with `cloudrl local down`")
    dash = Dashboard(resolve_address(address, local))
    typer.echo(sub.preflight(dash, cfg))
    job_id = sub.submit(dash, req, env_values)
    typer.echo(f"submitted {job_id} to {dash.address.url}")
    typer.echo(sub.next_steps(dash.address, job_id))
    if follow:
        typer.echo("")
        _follow(dash, job_id)


# ----------------------------------------------------------------------------------------------
# jobs
# ----------------------------------------------------------------------------------------------


@app.command(epilog="Example: cloudrl status --local")
def status(
    job: Annotated[Optional[str], typer.Argument(
        help="Job id; default: the latest job on the cluster.", show_default=False)] = None,
    address: AddressOpt = None,
    local: LocalOpt = False,
) -> None:
    """Show a job's status and the latest training metrics it logged."""
    from .jobs import status_text

    typer.echo(status_text(_dashboard(address, local), job))


@app.command(epilog="Example: cloudrl logs local-20250101-120000-a1b2 --follow")
def logs(
    job: JobArg,
    follow: Annotated[bool, typer.Option(
        "--follow", "-f", help="Stream until the job ends; exit 0 only if it succeeded. Ctrl+C detaches.")] = False,
    address: AddressOpt = None,
    local: LocalOpt = False,
) -> None:
    """Print a job's logs (its driver's stdout and stderr)."""
    from .jobs import job_logs

    dash = _dashboard(address, local)
    if follow:
        _follow(dash, job)
    else:
        typer.echo(job_logs(dash, job), nl=False)


@app.command(epilog="Example: cloudrl stop local-20250101-120000-a1b2")
def stop(job: JobArg, address: AddressOpt = None, local: LocalOpt = False) -> None:
    """Stop a running job and wait until Ray reports it stopped."""
    from .jobs import stop as stop_job

    typer.echo(stop_job(_dashboard(address, local), job))


@app.command("list", epilog="Example: cloudrl list --address http://127.0.0.1:8265")
def list_(address: AddressOpt = None, local: LocalOpt = False) -> None:
    """List the cluster's jobs: id, status, start, duration and preset."""
    from .jobs import list_text

    typer.echo(list_text(_dashboard(address, local)))


# ----------------------------------------------------------------------------------------------
# dashboard
# ----------------------------------------------------------------------------------------------


@app.command(epilog="Examples: cloudrl dashboard    |    cloudrl dashboard --ssh me@head-node")
def dashboard(
    run: Annotated[Optional[str], typer.Argument(
        help="dstack run name; default: the `name:` in tasks/ray-cluster.dstack.yml.", show_default=False)] = None,
    ssh: Annotated[Optional[str], typer.Option(
        "--ssh", metavar="HOST", show_default=False,
        help="Forward with plain ssh from this host (user@host, an ~/.ssh/config alias, or "
             "ssh://user@host:port) for clusters not made by dstack.")] = None,
    port: Annotated[Optional[int], typer.Option(
        "--port", "-p", show_default=False,
        help="Local port on 127.0.0.1. Default: 8265 if free, else any free port; 0 = any free port.")] = None,
    remote_port: Annotated[int, typer.Option(
        "--remote-port", help="The dashboard's port on the head node.")] = 8265,
    ssh_option: Annotated[Optional[list[str]], typer.Option(
        "--ssh-option", "-o", metavar="KEY=VALUE", show_default=False,
        help="Extra ssh option (repeatable), e.g. -o IdentityFile=~/.ssh/cluster.")] = None,
) -> None:
    """Forward a cluster's Ray dashboard to 127.0.0.1 and keep it up until Ctrl+C.

    A forward that `dstack apply` or `dstack attach` already holds is reused.
    """
    from .dashboard import run_dashboard

    run_dashboard(run, ssh, port, remote_port, ssh_option or [], typer.echo)


# ----------------------------------------------------------------------------------------------
# local cluster
# ----------------------------------------------------------------------------------------------


@local_app.command("up", epilog="Example: cloudrl local up --nodes 2")
def local_up(
    nodes: Annotated[int, typer.Option("--nodes", "-n", min=1, help="Ray nodes to start on 127.0.0.1.")] = 1,
    cpus: Annotated[Optional[int], typer.Option(
        "--cpus", min=1, show_default=False,
        help="Logical CPUs per node. Default: this machine's cores split over the nodes, at least 2 each "
             "and enough for the local preset.")] = None,
    gpus: Annotated[Optional[int], typer.Option(
        "--gpus", min=0, show_default=False,
        help="GPUs per node. Default: detected with one node, 0 with several (Ray would count each GPU "
             "once per node).")] = None,
    object_store_mb: Annotated[int, typer.Option(
        "--object-store-mb", min=80, help="Ray object store per node, in MB.")] = 512,
    dashboard_port: Annotated[int, typer.Option(
        "--dashboard-port", min=0, envvar="CLOUDRL_LOCAL_DASHBOARD_PORT",
        help="Dashboard port on 127.0.0.1; another free one if taken; 0 = any free port.")] = 8265,
    timeout: Annotated[float, typer.Option(
        "--timeout", help="Seconds to wait for all nodes to join.")] = 120.0,
) -> None:
    """Start a Ray cluster of N nodes on this machine and wait until every node has joined."""
    from . import local_cluster

    state = local_cluster.up(nodes, cpus, gpus, object_store_mb, dashboard_port, timeout, echo=typer.echo)
    typer.echo(f"local cluster up: {nodes} node(s) x {state['cpus_per_node']} CPUs, "
               f"dashboard {state['dashboard_url']}\n"
               f"submit:  cloudrl submit --local\n"
               f"stop it: cloudrl local down")


@local_app.command("down", epilog="Example: cloudrl local down")
def local_down() -> None:
    """Stop every process `cloudrl local up` started (and nothing else)."""
    from . import local_cluster

    local_cluster.down(echo=typer.echo)


# `cloudrl validate` comes from the bundle module; it stays registered here.
try:
    from .validate import validate as _validate
except ModuleNotFoundError as exc:  # only while the bundle module is not in this checkout
    if exc.name != f"{__package__}.validate":
        raise
else:
    app.command("validate", epilog="Example: cloudrl validate   (in the checkout, before `dstack apply`)")(_validate)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
