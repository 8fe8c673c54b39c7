"""Rendezvous stores that listen on one address: the roles' process groups and the SGLang weight-sync group.

torch's TCPStore server listens on every interface of its host on the port it is given, so anyone who can
reach any of the node's addresses could join a group or write its keys. `listening_store` binds the socket
itself, to the node's address alone, and hands it to the store; with port 0 the kernel picks the port at
bind time, so it is never free between choosing and listening.
"""

from __future__ import annotations

import socket
from datetime import timedelta


def listening_store(addr: str, world_size: int, timeout: timedelta, port: int = 0):
    """A TCPStore server (rank 0's side) listening on `addr` alone, at `port` (0: one the kernel picks).
    `.host`/`.port` say where the other ranks join."""
    import torch.distributed as dist

    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.bind((addr, port))
        listener.listen(128)
        port = listener.getsockname()[1]
        fd = listener.detach()  # the store owns the listening socket from here on
    except BaseException:
        listener.close()
        raise
    return dist.TCPStore(
        addr, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False, master_listen_fd=fd
    )
