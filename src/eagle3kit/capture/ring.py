"""The capture's host buffer: one shared-memory ring that the scheduler copies into and the writer process reads.

A ``memfd`` (anonymous shared memory, not limited by the size of /dev/shm) mapped in both processes. The scheduler
allocates a region per captured tensor (FIFO ring), copies into it (device-to-host, asynchronous once the ring is
registered with CUDA as pinned memory), and the writer process releases the regions of a job once its files are
written. A full ring blocks the allocating forward (back-pressure) instead of growing memory or dropping samples.
"""
from __future__ import annotations

import mmap
import os
import threading
import time
from collections import OrderedDict

import torch

ALIGN = 512  # every region starts aligned for any dtype (and for fast copies)


class RingTooSmall(ValueError):
    pass


class HostRing:
    def __init__(self, nbytes: int, fd: int | None = None):
        self.size = int(nbytes)
        if self.size < ALIGN:
            raise ValueError(f"capture buffer of {nbytes} bytes: use at least {ALIGN}")
        self.owner = fd is None
        if fd is None:
            fd = os.memfd_create("eagle3kit-capture", 0)
            os.ftruncate(fd, self.size)
        self.fd = fd
        self.mm = mmap.mmap(fd, self.size)
        self.buf = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.base = self.buf.data_ptr()
        self.pinned = False
        self._live: OrderedDict[int, list] = OrderedDict()  # start -> [end, released], in allocation order
        self._head = 0
        self._cv = threading.Condition()

    # -- views -----------------------------------------------------------------------------------------------
    def view(self, offset: int, shape, dtype: torch.dtype) -> torch.Tensor:
        n = int(torch.Size(shape).numel()) * dtype.itemsize
        return self.buf[offset:offset + n].view(dtype).view(tuple(shape))

    def empty(self, shape, dtype: torch.dtype, **alloc_kw) -> torch.Tensor:
        """A tensor in a new region of the ring (see ``alloc`` for blocking)."""
        return self.view(self.alloc(int(torch.Size(shape).numel()) * dtype.itemsize, **alloc_kw), shape, dtype)

    def offset_of(self, t: torch.Tensor) -> int:
        off = t.data_ptr() - self.base
        if not 0 <= off < self.size:
            raise ValueError("tensor does not live in the capture ring")
        return off

    # -- allocation (scheduler thread) and release (writer acknowledgements) ----------------------------------
    def _fits(self, n: int) -> int | None:
        if not self._live:
            self._head = 0
            return 0
        tail = next(iter(self._live))
        if self._head >= tail:  # used: [tail, head)
            if self._head + n <= self.size:
                return self._head
            return 0 if n < tail else None  # wrap around; strict: a full ring never looks empty
        return self._head if self._head + n < tail else None  # used: [tail, size) + [0, head)

    def alloc(self, nbytes: int, alive=lambda: True, on_wait=None, poll: float = 0.5) -> int:
        """Offset of a new region of ``nbytes``; blocks while the ring is full (then calls ``on_wait(seconds)``),
        raises if ``alive()`` turns False."""
        n = max(ALIGN, -(-int(nbytes) // ALIGN) * ALIGN)
        if n > self.size:
            raise RingTooSmall(f"one forward's capture of {nbytes / 2**20:.0f} MiB does not fit the capture buffer of "
                               f"{self.size / 2**20:.0f} MiB: raise max_inflight_mb (capture_config) or lower "
                               f"--chunked-prefill-size")
        with self._cv:
            off = self._fits(n)
            if off is None:
                t = time.perf_counter()
                while off is None:
                    if not alive():
                        raise RuntimeError("the capture writer process is gone: nothing can be written")
                    self._cv.wait(poll)
                    off = self._fits(n)
                if on_wait is not None:
                    on_wait(time.perf_counter() - t)
            self._live[off] = [off + n, False]
            self._head = off + n
        return off

    def release(self, offsets) -> None:
        with self._cv:
            for off in offsets:
                if off in self._live:
                    self._live[off][1] = True
            while self._live and next(iter(self._live.values()))[1]:
                self._live.popitem(last=False)
            self._cv.notify_all()

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    @property
    def used(self) -> int:
        with self._cv:
            return sum(end - start for start, (end, released) in self._live.items() if not released)

    # -- CUDA ------------------------------------------------------------------------------------------------
    def pin(self) -> bool:
        """Register the ring with CUDA as page-locked memory, so device-to-host copies into it are asynchronous."""
        if not self.pinned:
            err = torch.cuda.cudart().cudaHostRegister(self.base, self.size, 0)
            self.pinned = int(getattr(err, "value", err)) == 0
        return self.pinned

    def close(self) -> None:
        if self.pinned:
            unregister = getattr(torch.cuda.cudart(), "cudaHostUnregister", None)
            if unregister is not None:  # older torch binds only cudaHostRegister: the process exit unpins
                unregister(self.base)
            self.pinned = False
        del self.buf
        try:
            self.mm.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with the process
            pass
        if self.owner:
            os.close(self.fd)
