"""Private ``torch.distributed`` APIs (part of :mod:`cg_lightning.torch_compat`, which re-exports every name here):
coalesced broadcast, the rendezvous store, a group's collective timeout, and a store client whose calls are bounded.

Imports only torch.
"""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist


def broadcast_coalesced(group, tensors: List[torch.Tensor], buffer_size: int, src: int) -> bool:
    """``torch.distributed._broadcast_coalesced`` (what torch DDP broadcasts buffers with: few collectives, copied
    back into ``tensors``; ``src`` is group-local). Returns ``False`` without doing anything where the installed
    torch lacks it; the caller then broadcasts tensor by tensor (public)."""
    coalesced = getattr(dist, "_broadcast_coalesced", None)
    if coalesced is None:
        return False
    coalesced(group, tensors, buffer_size, src)
    return True


def default_store():
    """``torch.distributed.distributed_c10d._get_default_store``: the key-value store of the world group's
    rendezvous (the progress board reaches its host through it, :mod:`cg_lightning.ddp.progress`)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def set_group_timeout(seconds: float, group=None) -> bool:
    """``torch.distributed.distributed_c10d._set_pg_timeout``: the timeout of the collectives issued on ``group``
    (default: the world) from now on, for the gloo and NCCL backends. Returns ``False`` without doing anything
    where the installed torch lacks it."""
    import datetime

    from torch.distributed import distributed_c10d

    setter = getattr(distributed_c10d, "_set_pg_timeout", None)
    if setter is None:
        return False
    setter(datetime.timedelta(seconds=seconds), group)
    return True


def _socket_fds() -> set:
    import os
    import stat

    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if stat.S_ISSOCK(os.fstat(int(name)).st_mode):
                fds.add(int(name))
        except (OSError, ValueError):
            pass
    return fds


def bounded_store_client(host: str, port: int, timeout_s: float):
    """A ``torch.distributed.TCPStore`` client of ``host:port`` whose every call gives up after about ``timeout_s``
    (``get`` and ``multi_get``: twice that) with a ``DistNetworkError`` ("Socket Timeout").

    Relies on an implementation detail: once a request is sent, the client waits for the answer on its socket
    without a timeout of its own (``check``, ``get`` after its wait, a cancelled ``wait``), so a store host that is
    stopped (SIGSTOP, a debugger) or cut off without a reset blocks it for good. The kernel's receive and send
    timeouts are therefore set on the sockets the constructor opened (Linux ``/proc``; checked on torch 2.11 and
    2.13). Elsewhere, or if no such socket is found, the client is returned as torch makes it."""
    import datetime
    import os
    import socket
    import struct

    try:
        before = _socket_fds()
    except OSError:
        before = None
    client = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=timeout_s))
    if before is None:
        return client
    seconds = int(timeout_s)
    limit = struct.pack("ll", seconds, int((timeout_s - seconds) * 1e6))
    for fd in _socket_fds() - before:
        try:
            with socket.socket(fileno=os.dup(fd)) as sock:  # a duplicate: the options are the socket's own
                if sock.getpeername()[1] == port:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)
        except OSError:
            pass
    return client
