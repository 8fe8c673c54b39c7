"""bench/gpu_smoke.py on CPU: the single-GPU smoke test's code path runs, in a process where Ray and
vLLM cannot be imported (as on a GPU machine that has only torch and transformers)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Entries of None in sys.modules make `import ray` fail and importlib.util.find_spec("ray") return None,
# as when the package is not installed.
BLOCKED_RUN = (
    "import runpy, sys\n"
    "for name in sys.argv[1].split(','):\n"
    "    sys.modules[name] = None\n"
    "sys.argv = sys.argv[2:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def run_smoke(tmp_path: Path, blocked: str, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "smoke.json"
    proc = subprocess.run(
        [sys.executable, "-c", BLOCKED_RUN, blocked, "bench/gpu_smoke.py", "--device", "cpu", *args, "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def check_results(res: dict) -> None:
    numbers = {k: v for k, v in res.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert all(math.isfinite(v) for v in numbers.values()), numbers
    for key in ("gen_tokens_per_s", "update_s_per_step", "update_tokens_per_s", "peak_memory_gib", "params"):
        assert res[key] > 0, (key, res[key])
    assert res["params_changed"] == res["params_total"] > 0
    assert res["modules_loaded"] == []
    assert res["vllm"].startswith("skipped")
    assert res["mfu"] is None


def test_gpu_smoke_on_cpu(tmp_path):
    proc, res = run_smoke(tmp_path, "ray,vllm", "--model", "tiny", "--steps", "2")
    check_results(res)
    assert res["dtype"] == "float32" and res["sharded"] is False
    # Engine and trainer hold the same float32 weights after every sync.
    assert res["rollout/logprob_diff_max"] < 1e-3
    assert res["update/logprob_diff"] < 1e-3
    assert "| trained parameters changed" in proc.stdout and "ray / vllm imported" in proc.stdout


def test_gpu_smoke_fsdp_bf16_without_installed_package(tmp_path):
    """The GPU configuration on CPU (FSDP2 over gloo, bf16 compute over fp32 masters), run from a
    checkout where cloudrl is not installed."""
    _, res = run_smoke(
        tmp_path,
        "ray,vllm,cloudrl",
        "--model",
        "tiny",
        "--steps",
        "2",
        "--prompts",
        "4",
        "--max-new-tokens",
        "16",
        "--fsdp-on-cpu",
        "--dtype",
        "bfloat16",
    )
    check_results(res)
    assert res["dtype"] == "bfloat16" and res["sharded"] is True
    assert res["rollout/logprob_diff_max"] < 0.05


def test_gpu_smoke_with_two_ranks(tmp_path):
    """`--world 2`: one process per rank, FSDP2 over gloo here as over NCCL on two GPUs; rank 0 generates
    and the batch reaches rank 1 through the process group."""
    out = tmp_path / "smoke.json"
    proc = subprocess.run(
        [
            sys.executable,
            "bench/gpu_smoke.py",
            "--device",
            "cpu",
            "--model",
            "tiny",
            "--steps",
            "2",
            "--world",
            "2",
            "--prompts",
            "4",
            "--max-new-tokens",
            "8",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["world"] == 2 and res["sharded"] is True
    assert res["params_changed"] == res["params_total"] > 0
    assert res["rollout/logprob_diff_max"] < 1e-3  # float32: the gathered weights are the engine's weights
