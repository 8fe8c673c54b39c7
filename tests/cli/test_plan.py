"""`cloudrl plan`: the memory table from a model's config.json alone, and the one-line refusal (exit 1)."""

from __future__ import annotations

import typer.testing
from cloudrl.cli.app import app

runner = typer.testing.CliRunner()


def test_plan_prints_each_role_and_engine(qwen_7b):
    result = runner.invoke(app, ["plan", "--preset", "gsm8k-7b", f"model.path={qwen_7b}"])
    assert result.exit_code == 0, result.output
    for heading in ("actor (per GPU, 4 GPU(s))", "critic (per GPU, 4 GPU(s))", "rollout (vllm) (per GPU, 8 GPU(s))"):
        assert heading in result.output
    assert "DOES NOT FIT" not in result.output
    assert "KV cache: " in result.output and "tokens per engine GPU" in result.output


def test_plan_refuses_in_one_line_naming_the_keys(qwen_7b):
    result = runner.invoke(app, ["plan", "-p", "gsm8k-7b", f"model.path={qwen_7b}", "actor.fsdp=false"])
    assert result.exit_code == 1
    assert "DOES NOT FIT" in result.output  # the table comes first
    refusal = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(refusal) == 1
    assert "actor needs" in refusal[0] and "actor.fsdp=true" in refusal[0]
    assert "Traceback" not in result.output


def test_gpu_memory_gib_sets_the_limit(qwen_7b):
    # The gsm8k-7b actor peaks near 40 GiB per GPU: a 24 GiB GPU is refused, its fixes named.
    result = runner.invoke(app, ["plan", "-p", "gsm8k-7b", f"model.path={qwen_7b}", "--gpu-memory-gib", "24"])
    assert result.exit_code == 1
    assert "a GPU has 24 GiB" in result.output
    assert "actor.cpu_offload=true" in result.output


def test_unreadable_model_config_is_one_line(tmp_path):
    result = runner.invoke(app, ["plan", "-p", "gsm8k-7b", f"model.path={tmp_path}"])
    assert result.exit_code == 1
    assert f"cannot read the model config of model.path={tmp_path}" in result.output
    assert "config.json" in result.output
    assert "Traceback" not in result.output


def test_bad_gpu_memory_is_refused(qwen_7b):
    result = runner.invoke(app, ["plan", "-p", "gsm8k-7b", f"model.path={qwen_7b}", "--gpu-memory-gib", "0"])
    assert result.exit_code == 1
    assert "--gpu-memory-gib 0: give the memory of one GPU" in result.output


def test_submit_refuses_a_run_that_cannot_fit_before_contacting_a_cluster(qwen_7b, monkeypatch):
    """`cloudrl submit` of a GPU run checks its memory plan first: a layout that cannot fit is one line naming
    the role, its need and the fix, with nothing sent (a dead RAY_ADDRESS: any contact would fail otherwise)."""
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:9")
    refused = runner.invoke(app, ["submit", "-p", "gsm8k-7b", f"model.path={qwen_7b}", "actor.fsdp=false"])
    assert refused.exit_code == 1
    (line,) = [line for line in refused.output.splitlines() if line.startswith("error:")]
    assert "actor needs" in line and "actor.fsdp=true" in line and "127.0.0.1:9" not in refused.output
    small = runner.invoke(app, ["submit", "-p", "gsm8k-7b", f"model.path={qwen_7b}", "--gpu-memory-gib", "24"])
    assert small.exit_code == 1 and "a GPU has 24 GiB" in small.output
    fits = runner.invoke(app, ["submit", "-p", "gsm8k-7b", f"model.path={qwen_7b}", "--dry-run"])
    assert fits.exit_code == 0, fits.output
