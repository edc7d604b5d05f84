"""Weights read off their file rather than through its memory map.

safetensors loads a model as views of one private memory map of the file: nothing is read until
touched, and every page touched then counts in the process's resident memory for as long as any
view lives. Repacking or quantising the weights through those views therefore holds the whole
file resident next to the new copies (the 1.5B target: 6 GiB of file pages on top of 6 GiB of
packed weights). :func:`own_copy` reads a mapped tensor's bytes with ``pread`` from the file into
memory of its own instead, so the map is never faulted in and a model converted layer by layer
peaks at its final size plus one layer.

Converting a model frees one temporary per layer; glibc's allocator would keep those in its heap
(its mmap threshold rises to the largest block freed) and the process would grow by gigabytes of
free-but-held memory: :func:`returning_freed_memory` keeps large blocks mapped while converting.

The file's bytes equal the mapped bytes as long as nobody wrote into the private map; loaders
never do (a model's weights are not modified in place after loading).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FileMapping:
    """One file-backed region of this process's address space (a line of ``/proc/self/maps``)."""

    start: int
    end: int
    file_offset: int
    path: str


def file_mappings() -> list[FileMapping]:
    """The private file mappings of this process (Linux); empty where ``/proc`` is absent."""
    mappings = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) < 6 or not fields[1].endswith("p") or not fields[5].startswith("/"):
                    continue
                path = fields[5].rstrip("\n")
                if path.endswith(" (deleted)"):
                    continue
                start, end = (int(x, 16) for x in fields[0].split("-"))
                mappings.append(FileMapping(start, end, int(fields[2], 16), path))
    except OSError:
        return []
    return mappings


def backing_file(tensor: torch.Tensor, mappings: list[FileMapping]) -> tuple[str, int] | None:
    """``(path, offset)`` of the file bytes behind a contiguous CPU ``tensor``, or None when its
    memory is not a file mapping."""
    if tensor.device.type != "cpu" or tensor.is_mkldnn or not tensor.is_contiguous() or tensor.numel() == 0:
        return None
    first, last = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
    for region in mappings:
        if region.start <= first and last <= region.end:
            return region.path, region.file_offset + first - region.start
    return None


def own_copy(tensor: torch.Tensor, mappings: list[FileMapping] | None = None) -> torch.Tensor:
    """A copy of ``tensor`` in memory of its own: read from its file when it is a view of a file
    mapping (see the module docstring), else ``tensor.clone()``. ``mappings`` defaults to
    :func:`file_mappings` (pass it when copying many tensors)."""
    tensor = tensor.detach()
    source = backing_file(tensor, file_mappings() if mappings is None else mappings)
    if source is None:
        return tensor.clone()
    path, offset = source
    copy = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    buffer = memoryview(copy.view(-1).view(torch.uint8).numpy())
    with open(path, "rb", buffering=0) as file:
        done = 0
        while done < len(buffer):
            read = os.preadv(file.fileno(), [buffer[done:]], offset + done)
            if read <= 0:
                return tensor.clone()  # the file shrank under its map: fall back to the mapped bytes
            done += read
    return copy


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters, glibc's malloc.h
_HEAP_MAX_MMAP_THRESHOLD = 32 << 20  # where glibc's dynamic threshold tops out on 64-bit
# Free memory glibc keeps at the top of its heap before giving it back. A threshold set with
# mallopt stops glibc from raising this one (128 KiB) as it would raise it dynamically, and a
# decoding step then gave its freed megabytes back and faulted them in again: 900 to 1,500 page
# faults a step of the embedded pair's chain on 2 cores, fewer than 20 with this.
_STEP_TRIM_THRESHOLD = 64 << 20


_converting = 0
_converting_lock = threading.Lock()


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


@contextmanager
def returning_freed_memory(threshold: int = 1 << 20) -> Iterator[None]:
    """Inside: blocks of ``threshold`` bytes or more get memory maps of their own, so freeing them
    returns them to the system at once. After: glibc's usual ceiling is restored, free heap memory
    is trimmed, and up to ``_STEP_TRIM_THRESHOLD`` of freed memory is kept from then on (a decoding
    step's few-megabyte buffers are reused from the heap, not faulted in anew). A no-op off glibc."""
    global _converting
    libc = _glibc()
    if libc is None:
        yield
        return
    with _converting_lock:
        _converting += 1
        libc.mallopt(_M_MMAP_THRESHOLD, threshold)
    try:
        yield
    finally:
        with _converting_lock:
            _converting -= 1
            if not _converting:  # the outermost of nested (or concurrent) conversions
                libc.mallopt(_M_MMAP_THRESHOLD, _HEAP_MAX_MMAP_THRESHOLD)
                libc.malloc_trim(0)
                libc.mallopt(_M_TRIM_THRESHOLD, _STEP_TRIM_THRESHOLD)
