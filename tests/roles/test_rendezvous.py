"""The roles' process-group rendezvous (trainer/rendezvous.py `listening_store`): rank 0's TCPStore listens on its node's
address alone, on a port it holds from the moment the kernel picks it, and ranks join a gloo group through it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from datetime import timedelta

import psutil
import pytest
import torch.distributed as dist
from cloudrl.trainer.rendezvous import listening_store

RANK = """
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from cloudrl.trainer.rendezvous import listening_store

rank = int(sys.argv[1])
timeout = timedelta(seconds=60)
if rank == 0:
    store = listening_store("127.0.0.1", 2, timeout)
    print(store.port, flush=True)
else:  # rank 0's port on stdin, once rank 0's store holds it
    store = dist.TCPStore("127.0.0.1", int(sys.stdin.readline()), 2, is_master=False, timeout=timeout)
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
value = torch.tensor([rank + 1.0])
dist.all_reduce(value)
print(f"sum {value.item()}", flush=True)
dist.destroy_process_group()
"""


def _listening(port: int) -> list[str]:
    return [
        c.laddr.ip
        for c in psutil.Process(os.getpid()).net_connections("inet")
        if c.status == "LISTEN" and c.laddr.port == port
    ]


def test_the_store_listens_on_its_address_alone_and_holds_its_port():
    store = listening_store("127.0.0.1", 2, timedelta(seconds=10))
    assert _listening(store.port) == ["127.0.0.1"]  # not 0.0.0.0 / :: (every interface)
    # The port is the store's from the start: no window in which another process could bind it.
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", store.port))
    client = dist.TCPStore("127.0.0.1", store.port, 2, is_master=False, timeout=timedelta(seconds=10))
    client.set("key", "value")
    assert store.get("key") == b"value"


def test_two_ranks_form_a_gloo_group_through_it():
    # Both ranks start (and import torch) at once; rank 1 learns the port when rank 0's store has it.
    first = subprocess.Popen([sys.executable, "-c", RANK, "0"], stdout=subprocess.PIPE, text=True)
    second = subprocess.Popen(
        [sys.executable, "-c", RANK, "1"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        port = first.stdout.readline().strip()
        assert port.isdigit(), port
        out, err = second.communicate(f"{port}\n", timeout=120)
        assert second.returncode == 0, err[-2000:]
        assert "sum 3.0" in out
        out, _ = first.communicate(timeout=60)
        assert first.returncode == 0 and "sum 3.0" in out
    finally:
        for proc in (first, second):
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
