"""`cloudrl plan --offers`: the dstack offers a config fits on (memory plan and placement), cheapest per hour
of the whole cluster first. The offers are dstack's own JSON: built with dstack's models, written with
`model_dump_json` as `dstack offer --json` writes them."""

from __future__ import annotations

import json

import pytest
import typer.testing
from cloudrl.cli.app import app

runner = typer.testing.CliRunner()


# backend, region, instance, CPUs, GPUs, GPU, GPU MiB, spot, $/h per node, availability
OFFERS = [
    ("aws", "us-east-1", "p5.48xlarge", 192, 8, "H100", 81559, False, 98.32, "available"),
    ("runpod", "EU-SE-1", "8x-a100-80gb", 128, 8, "A100", 81920, True, 12.00, "available"),
    ("lambda", "us-west-1", "gpu_4x_a100_80gb", 64, 4, "A100", 81920, False, 5.16, "available"),
    ("vastai", "pl-greece", "8x-rtx4090", 64, 8, "RTX4090", 24576, False, 3.00, "available"),
    ("gcp", "us-central1", "a3-highgpu-8g", 208, 8, "H100", 81920, False, 88.00, "not_available"),
    ("aws", "us-east-1", "c7i.48xlarge", 192, 0, "", 0, False, 8.57, "available"),
    ("runpod", "US-TX-3", "1x-h100-80gb", 32, 1, "H100", 81920, False, 2.49, "available"),
]


def dstack_offer_json(rows=OFFERS) -> str:
    from dstack._internal.core.models.backends.base import BackendType
    from dstack._internal.core.models.instances import (
        Gpu,
        InstanceAvailability,
        InstanceOfferWithAvailability,
        InstanceType,
        Resources,
    )

    offers = []
    for backend, region, name, cpus, gpus, gpu, mib, spot, price, availability in rows:
        resources = Resources(
            cpus=cpus, memory_mib=cpus * 8192, gpus=[Gpu(name=gpu, memory_mib=mib) for _ in range(gpus)], spot=spot
        )
        offer = InstanceOfferWithAvailability(
            backend=BackendType(backend),
            region=region,
            price=price,
            instance=InstanceType(name=name, resources=resources),
            availability=InstanceAvailability(availability),
        )
        offers.append(json.loads(offer.model_dump_json()))
    return json.dumps({"project": "main", "user": "admin", "offers": offers, "total_offers": len(offers)})


@pytest.fixture
def offers_file(tmp_path):
    path = tmp_path / "offers.json"
    path.write_text(dstack_offer_json())
    return path


def table(output: str) -> list[list[str]]:
    """The rows under the `$/h total` header, split on runs of 2+ spaces."""
    import re

    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("$/h total"))
    rows = [re.split(r"\s{2,}", line) for line in lines[start + 1 :]]
    return [row for row in rows if len(row) == 8]


def test_the_fitting_offers_print_cheapest_first_with_their_node_counts(qwen_7b, offers_file):
    """gsm8k-7b needs 16 GPUs (actor 4, critic 4, four engines of 2) near 40 GiB each: four 4-GPU nodes or
    two 8-GPU ones; 24 GiB GPUs, one-GPU nodes (an engine spans 2), CPU-only and unavailable offers never fit."""
    result = runner.invoke(app, ["plan", "-p", "gsm8k-7b", f"model.path={qwen_7b}", "--offers", str(offers_file)])
    assert result.exit_code == 0, result.output
    assert [row[:4] for row in table(result.output)] == [
        ["20.64", "4", "5.16", "gpu_4x_a100_80gb"],
        ["24.00", "2", "12.00", "8x-a100-80gb"],
        ["196.64", "2", "98.32", "p5.48xlarge"],
    ]
    assert "8x H100 79.6GiB" in result.output and "3 of 6 offers that can be had fit" in result.output
    assert "rollout: 4 worker(s), 4 x (2 CPU, 2 GPU), PACK" in result.output  # the layout, once
    for absent in ("8x-rtx4090", "a3-highgpu-8g", "c7i.48xlarge", "1x-h100-80gb"):
        assert absent not in result.output


def test_max_price_bounds_the_whole_clusters_price(qwen_7b, offers_file):
    args = ["plan", "-p", "gsm8k-7b", f"model.path={qwen_7b}", "--offers", str(offers_file), "--max-price", "22"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert [row[3] for row in table(result.output)] == ["gpu_4x_a100_80gb"]


def test_no_fitting_offer_is_one_line_and_exit_1(qwen_7b, offers_file):
    args = ["plan", "-p", "gsm8k-7b", f"model.path={qwen_7b}", "--offers", str(offers_file), "--max-price", "5"]
    result = runner.invoke(app, args)
    assert result.exit_code == 1
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: no offer in {offers_file} fits the config within --max-price 5: `cloudrl plan` without --offers "
        "shows what each GPU must hold; ask dstack for GPUs with more memory or more of them per node"
    ]


def test_a_cpu_run_fits_any_offer_with_the_cpus(offers_file):
    result = runner.invoke(app, ["plan", "--offers", str(offers_file)])
    assert result.exit_code == 0, result.output
    rows = table(result.output)
    assert rows[0][3] == "1x-h100-80gb" and "c7i.48xlarge" in {r[3] for r in rows}
    assert [float(r[0]) for r in rows] == sorted(float(r[0]) for r in rows)


@pytest.mark.parametrize(
    "content, problem",
    [
        (None, "cannot read it"),
        ("{not json", "not JSON"),
        ('{"project": "main"}', "no `offers` list"),
        ('{"offers": [{"backend": "aws", "price": 1.0}]}', "offer 0 is not an offer as dstack writes it (KeyError"),
        (
            '{"offers": [{"backend": "aws", "region": "r", "price": -1, '
            '"instance": {"name": "x", "resources": {"cpus": 4, "gpus": []}}}]}',
            "offer 0 is not an offer as dstack writes it (ValueError: a negative price",
        ),
    ],
)
def test_a_file_that_is_not_dstacks_offers_is_one_line(tmp_path, content, problem):
    path = tmp_path / "offers.json"
    if content is not None:
        path.write_text(content)
    result = runner.invoke(app, ["plan", "--offers", str(path)])
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    assert errors[0].startswith(f"error: --offers {path}: {problem}"), errors[0]
    assert errors[0].endswith("give the output of `dstack offer --json` (saved, or `-`)")


def test_offers_read_from_stdin(qwen_7b):
    args = ["plan", "-p", "gsm8k-7b", f"model.path={qwen_7b}", "--offers", "-"]
    result = runner.invoke(app, args, input=dstack_offer_json())
    assert result.exit_code == 0, result.output
    assert len(table(result.output)) == 3
