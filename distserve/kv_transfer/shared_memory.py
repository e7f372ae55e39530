"""A CPU tensor in shared memory that another process on the same machine maps and reads in place.

The memory is an anonymous memory file (``memfd_create``): it has no name anywhere, so nothing is
left behind when its process dies, even by SIGKILL, and its pages go back once the last process
mapping them unmaps them. Nor is it bound by the size of /dev/shm, which containers often keep
small (64 MiB under Docker by default). Another process opens it through ``/proc/<pid>/fd/<fd>``
while the owner keeps the descriptor open. That path names another file, or none, from another
container or pid namespace, so the opener checks the file's device and inode first.
"""

from __future__ import annotations

import math
import os
import weakref
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SharedFile:
    """How another process on this machine maps a tensor held in a memory file of its owner."""

    pid: int
    fd: int
    device: int  # the file's st_dev and st_ino: what /proc/<pid>/fd/<fd> must still name
    inode: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def path(self) -> str:
        return f"/proc/{self.pid}/fd/{self.fd}"

    def open(self) -> torch.Tensor:
        """The owner's tensor, mapped into this process. OSError where it cannot be: another
        machine, container or pid namespace, or no permission to open the owner's descriptors."""
        stat = os.stat(self.path)
        if (stat.st_dev, stat.st_ino) != (self.device, self.inode):
            raise OSError(f"{self.path} is not the owner's memory file: another process has that pid here")
        return _map(self.path, self.shape, self.dtype)


def shared_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, SharedFile]:
    """A zeroed tensor in a memory file of this process, and how another process maps it. The
    descriptor stays open as long as the tensor object lives. OSError where the system has no
    memory files."""
    if not hasattr(os, "memfd_create"):
        raise OSError("no memfd_create on this system")
    fd = os.memfd_create("distserve-kv", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, math.prod(shape) * torch.empty((), dtype=dtype).element_size())
        tensor = _map(f"/proc/self/fd/{fd}", shape, dtype)
    except BaseException:
        os.close(fd)
        raise
    weakref.finalize(tensor, os.close, fd)
    # The file reads as zeros already; writing them commits its pages now, as an anonymous cache's
    # would be, so the memory is counted (and found missing) at start-up rather than mid-serving.
    tensor.zero_()
    stat = os.fstat(fd)
    return tensor, SharedFile(os.getpid(), fd, stat.st_dev, stat.st_ino, tuple(shape), dtype)


def _map(path: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.from_file(path, shared=True, size=math.prod(shape), dtype=dtype).view(shape)
