"""`cloudrl plan --offers FILE`: which of dstack's offers a config fits on, cheapest first.

FILE is what `dstack offer --json` printed (or `-`: read it from stdin). For each offer that can be had
(not `not_available`, `no_quota` or `no_balance`), the config must pass both checks the trainer itself makes:
the memory plan of every role's GPU against the offer's GPU memory (trainer/memory_plan.py), and the
placement of every role's bundles on N such nodes (trainer/roles/placement.py's `check_fits`, the same check
as against a live cluster), for the fewest N up to `max_nodes`. The fitting offers print cheapest per hour
of the whole cluster first.

    fits = fitting(cfg, read_offers(Path("offers.json")), max_price=40)
    print(offers_text(cfg, fits))
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .errors import CloudrlError

UNAVAILABLE = {"not_available", "no_quota", "no_balance"}
"""dstack's availability values of offers that cannot be had now."""
MAX_NODES = 64


@dataclass(frozen=True)
class Offer:
    backend: str
    region: str
    instance: str
    cpus: int
    gpus: int
    gpu_name: str
    gpu_memory_gib: float
    spot: bool
    price: float
    """Per node and hour, in dstack's currency (USD)."""


@dataclass(frozen=True)
class Fit:
    offer: Offer
    nodes: int

    @property
    def price(self) -> float:
        return self.offer.price * self.nodes


def _bad(source: str, problem: str) -> CloudrlError:
    return CloudrlError(f"--offers {source}: {problem}: give the output of `dstack offer --json` (saved, or `-`)")


def _parse(offer: dict, where: str, source: str) -> Offer | None:
    """One offer of dstack's JSON; None for one that cannot be had now."""
    try:
        if offer.get("availability") in UNAVAILABLE:
            return None
        resources = offer["instance"]["resources"]
        gpus = resources.get("gpus") or []
        names = {str(g["name"]) for g in gpus}
        memory = {float(g["memory_mib"]) for g in gpus}
        if len(names) > 1 or len(memory) > 1:
            return None  # mixed GPUs in one instance: the plan assumes one kind
        price, cpus = float(offer["price"]), int(resources["cpus"])
        if price < 0 or cpus < 0:
            raise ValueError("a negative price or CPU count")
        return Offer(
            backend=str(offer["backend"]),
            region=str(offer["region"]),
            instance=str(offer["instance"]["name"]),
            cpus=cpus,
            gpus=len(gpus),
            gpu_name=names.pop() if names else "",
            gpu_memory_gib=memory.pop() / 1024 if memory else 0.0,
            spot=bool(resources.get("spot", False)),
            price=price,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise _bad(source, f"{where} is not an offer as dstack writes it ({type(exc).__name__}: {exc})") from None


def read_offers(path: str) -> list[Offer]:
    """The offers in `path` (`-`: stdin) that can be had now; CloudrlError in one line for anything else."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as exc:
        raise _bad(path, f"cannot read it ({exc.strerror or exc})") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise _bad(path, f"not JSON ({exc})") from None
    offers = data.get("offers") if isinstance(data, dict) else None
    if not isinstance(offers, list):
        raise _bad(path, "no `offers` list")
    parsed = [_parse(o, f"offer {i}", path) if isinstance(o, dict) else None for i, o in enumerate(offers)]
    return [o for o in parsed if o is not None]


def fitting(cfg, offers: list[Offer], max_price: float = 0.0, max_nodes: int = MAX_NODES) -> list[Fit]:
    """The offers `cfg` fits on (memory plan and placement), each with the fewest nodes it needs, cheapest per
    hour of the whole cluster first; `max_price` > 0 leaves out clusters that cost more per hour."""
    from cloudrl.trainer.errors import ModelLoadError
    from cloudrl.trainer.memory_plan import DoesNotFit, check_fits
    from cloudrl.trainer.roles.placement import ClusterTooSmall, plan
    from cloudrl.trainer.roles.placement import check_fits as placement_fits

    from .plan import planner, uses_gpus

    requests = plan(cfg)
    memory_fits: dict[float, bool] = {}
    fits = []
    for offer in offers:
        if uses_gpus(cfg):
            if offer.gpus == 0:
                continue
            if offer.gpu_memory_gib not in memory_fits:
                try:
                    check_fits(cfg, planner(cfg, offer.gpu_memory_gib), offer.gpu_memory_gib)
                    memory_fits[offer.gpu_memory_gib] = True
                except DoesNotFit:
                    memory_fits[offer.gpu_memory_gib] = False
                except ModelLoadError as exc:
                    raise CloudrlError(f"--offers: the memory plan needs the model's config.json: {exc}") from None
            if not memory_fits[offer.gpu_memory_gib]:
                continue
        node = {"CPU": float(offer.cpus), "GPU": float(offer.gpus)}
        for n in range(1, max_nodes + 1):
            try:
                placement_fits(requests, [dict(node) for _ in range(n)])
            except ClusterTooSmall:
                continue
            if max_price <= 0 or offer.price * n <= max_price:
                fits.append(Fit(offer, n))
            break
    return sorted(fits, key=lambda f: (f.price, f.nodes, f.offer.backend, f.offer.region, f.offer.instance))


def layout_text(cfg) -> str:
    """Each role's placement request: its bundles and what one holds."""
    from cloudrl.trainer.roles.placement import plan

    lines = []
    for req in plan(cfg):
        shapes: dict[str, int] = {}
        for bundle in req.bundles:
            shape = ", ".join(f"{v:g} {k}" for k, v in sorted(bundle.items()))
            shapes[shape] = shapes.get(shape, 0) + 1
        held = " + ".join(f"{count} x ({shape})" for shape, count in shapes.items())
        extra = f"; with it: {', '.join(req.guests + req.in_process)}" if req.guests or req.in_process else ""
        lines.append(f"  {req.role}: {req.num_workers} worker(s), {held}, {req.strategy}{extra}")
    return "\n".join(lines)


def offers_text(cfg, fits: list[Fit], considered: int) -> str:
    """The layout, then a table of the fitting offers (cheapest first)."""
    out = ["layout (the same on every offer below):", layout_text(cfg), ""]
    if not fits:
        out.append(f"none of the {considered} offers that can be had fits this config")
        return "\n".join(out)
    header = ("$/h total", "nodes", "$/h node", "instance", "GPUs", "backend", "region", "spot")
    rows = [
        (
            f"{f.price:.2f}",
            str(f.nodes),
            f"{f.offer.price:.2f}",
            f.offer.instance,
            f"{f.offer.gpus}x {f.offer.gpu_name} {round(f.offer.gpu_memory_gib, 1):g}GiB" if f.offer.gpus else "-",
            f.offer.backend,
            f.offer.region,
            "yes" if f.offer.spot else "no",
        )
        for f in fits
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    out.append(f"{len(fits)} of {considered} offers that can be had fit; cheapest first")
    return "\n".join(out)


def show_offers(preset: str, overrides: list[str], path: str, max_price: float, echo: Callable[[str], None]) -> None:
    """Print the layout and the offers of `path` (dstack offer --json) the config fits on, cheapest first;
    CloudrlError (exit 1) when none does."""
    from .errors import CloudrlError
    from .submit import load_config

    if max_price < 0:
        raise CloudrlError(f"--max-price {max_price:g}: give the most per hour for all nodes, e.g. 60 (0: no limit)")
    cfg = load_config(preset, overrides)
    offers = read_offers(path)
    fits = fitting(cfg, offers, max_price)
    echo(offers_text(cfg, fits, len(offers)))
    if not fits:
        limit = f" within --max-price {max_price:g}" if max_price > 0 else ""
        raise CloudrlError(
            f"no offer in {path} fits the config{limit}: `cloudrl plan` without --offers shows what each GPU must "
            f"hold; ask dstack for GPUs with more memory or more of them per node"
        )
