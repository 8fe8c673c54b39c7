"""What a GPU process costs before any tensor: the CUDA context, the caching allocator's first block, NCCL.

    python bench/gpu_overheads.py            # one CUDA device; prints a table (MiB) and exits 1 without CUDA

The memory plan (trainer/memory_plan.py) counts these per process; this script measures them on the
device at hand with the driver's own count of used memory (nvidia-smi's, which torch's allocator statistics
do not see): before CUDA is touched, after the context is created, after a first 1 MiB tensor, after a
world-size-1 NCCL group's first all-reduce (its communicator and buffers; more ranks add more channels), and
after a matrix product (cuBLAS's workspace). Each row is the growth over the one before.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys


def used_mib(index: int) -> float:
    """Device memory in use, as the driver counts it (every process's contexts included)."""
    out = subprocess.run(
        ["nvidia-smi", f"--id={index}", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return float(out.stdout.strip())


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: this measures GPU memory only", file=sys.stderr)
        return 1
    index = int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or 0)
    rows = [("nothing touched", used_mib(index))]
    torch.cuda.init()
    torch.cuda.current_stream().synchronize()
    rows.append(("CUDA context", used_mib(index)))
    x = torch.ones(1 << 18, device="cuda")  # 1 MiB of fp32
    torch.cuda.synchronize()
    rows.append(("first tensor (1 MiB)", used_mib(index)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.distributed.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, device_id=torch.device("cuda:0")
    )
    torch.distributed.all_reduce(x)
    torch.cuda.synchronize()
    rows.append(("NCCL group, first all-reduce", used_mib(index)))
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    rows.append(("bf16 matmul (cuBLAS workspace + 64 MiB of tensors)", used_mib(index)))
    torch.distributed.destroy_process_group()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}")
    print(f"{'after':<52} {'used MiB':>9} {'growth MiB':>11}")
    for i, (name, used) in enumerate(rows):
        growth = used - rows[i - 1][1] if i else 0.0
        print(f"{name:<52} {used:>9.0f} {growth:>11.0f}")
    print(f"{'a process with CUDA and NCCL, before its own tensors':<52} {'':>9} {rows[3][1] - rows[0][1] - 1:>11.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
