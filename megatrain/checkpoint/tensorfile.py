"""Safetensors files written and read in one streaming pass, their sha256 computed on the way.

Why not `safetensors.torch.save_file` / `safe_open`: save_file builds the whole file in memory (a second copy of a
unit's state) and the readers map the file. Here bytes go straight from the store's memory to the file and
straight from the file into the store, in pieces, and the checksum is computed over the same bytes as they pass:
a save or a resume needs no buffer beyond one piece, and a checksum costs no extra pass over the data.
The files are standard safetensors (8-byte little-endian header length, JSON header, tensor data), so
`safe_open` and transformers read them too.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import torch

from ..errors import MegatrainError
from .fastio import CHUNK

DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
DTYPE_OF = {v: k for k, v in DTYPES.items()}
PIECE = 64 << 20  # bytes per write/read call: large enough for full disk speed, small enough to bound memory
MAX_HEADER = 100 << 20


def _bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (numpy has no bf16, so go through uint8)."""
    if not t.is_contiguous():
        raise ValueError("tensor must be contiguous")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def tensor_nbytes(dtype: torch.dtype, shape) -> int:
    n = torch.empty((), dtype=dtype).element_size()
    for s in shape:
        n *= s
    return n


def header_bytes(plan: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict | None = None) -> bytes:
    """The file's first bytes (8-byte length, JSON header padded to 8) for tensors stored in `plan` order."""
    header, off = {}, 0
    for name, dtype, shape in plan:
        n = tensor_nbytes(dtype, shape)
        header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned, as the format recommends
    return struct.pack("<Q", len(raw)) + raw


def read_header(path: Path, expected_size: int | None = None) -> tuple[bytes, list, dict]:
    """(the header's bytes, entries (start, end, name, dtype, shape) sorted by offset, metadata) of a safetensors
    file; MegatrainError naming the file when it is missing, of another size than expected, or not safetensors."""
    path = Path(path)
    if not path.is_file():
        raise MegatrainError(f"{path}: checkpoint file is missing")
    actual = path.stat().st_size
    if expected_size is not None and actual != expected_size:
        raise MegatrainError(f"{path}: truncated or altered: {actual} bytes, the manifest says {expected_size}")
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise MegatrainError(f"{path}: truncated (ends inside its header)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > actual:
            raise MegatrainError(f"{path}: not a safetensors file (header length {n})")
        raw = f.read(n)
    try:
        header = json.loads(raw)
        metadata = header.pop("__metadata__", {}) or {}
        entries = sorted(((v["data_offsets"][0], v["data_offsets"][1], k, DTYPE_OF[v["dtype"]], tuple(v["shape"]))
                          for k, v in header.items()))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise MegatrainError(f"{path}: not a safetensors file (unreadable header)") from None
    except (KeyError, TypeError, IndexError, AttributeError):
        raise MegatrainError(f"{path}: safetensors header has an entry megatrain does not read") from None
    return head + raw, entries, metadata


class TensorFileWriter:
    """Writes the planned tensors, in plan order, to `path`, on the calling thread: the single writer (a save whose
    states are staged from the SSD tier one kind at a time). `close()` fsyncs and returns the manifest entry:
    bytes and the sha256 of every `chunk_bytes` chunk, as fastio.ChunkWriter records them."""

    def __init__(self, path: Path, plan: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict | None = None,
                 chunk_bytes: int = CHUNK):
        self.path = Path(path)
        self._plan = list(plan)
        self._next = 0
        self.chunk = chunk_bytes
        self.hashes: list[str] = []
        self.sha = hashlib.sha256()
        self.size = 0
        self.file = open(self.path, "wb")
        self._put(memoryview(header_bytes(plan, metadata)))

    def _put(self, mv: memoryview) -> None:
        a = 0
        while a < len(mv):
            room = self.chunk - self.size % self.chunk  # to the end of the current chunk
            piece = mv[a: a + min(PIECE, room)]
            self.file.write(piece)
            self.sha.update(piece)  # hashlib releases the GIL on large buffers: training threads keep running
            self.size += len(piece)
            a += len(piece)
            if self.size % self.chunk == 0:
                self.hashes.append(self.sha.hexdigest())
                self.sha = hashlib.sha256()

    def write(self, t: torch.Tensor) -> None:
        name, dtype, shape = self._plan[self._next]
        if t.dtype != dtype or tuple(t.shape) != tuple(shape):
            raise ValueError(f"{self.path}: tensor {name} planned as {dtype}{list(shape)}, got {t.dtype}{list(t.shape)}")
        self._next += 1
        self._put(_bytes(t))

    def close(self) -> dict:
        if self._next != len(self._plan):
            raise ValueError(f"{self.path}: {len(self._plan) - self._next} planned tensors were not written")
        if self.size % self.chunk:
            self.hashes.append(self.sha.hexdigest())
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        return {"bytes": self.size, "chunk_bytes": self.chunk, "sha256_chunks": self.hashes}

    def abort(self) -> None:
        self.file.close()


class TensorFileReader:
    """Reads a safetensors file front to back, tensor by tensor, hashing every byte; `finish` checks the hash.

        r = TensorFileReader(path, expected_size)
        for name, dtype, shape in r:      # in file order
            r.read_into(view) | t = r.read() | r.skip()
        r.finish(expected_sha256)         # MegatrainError naming the file if it was altered
    """

    def __init__(self, path: Path, expected_size: int | None = None):
        self.path = Path(path)
        head, self.entries, self.metadata = read_header(self.path, expected_size)
        self.size = self.path.stat().st_size
        self.sha = hashlib.sha256(head)
        self.file = open(self.path, "rb")
        self.file.seek(len(head))
        self._pos = 0  # offset into the data section
        self._k = 0

    def _fill(self, mv: memoryview) -> None:
        for a in range(0, len(mv), PIECE):
            piece = mv[a: a + PIECE]
            got = self.file.readinto(piece)
            if got != len(piece):
                raise MegatrainError(f"{self.path}: truncated (ends inside tensor '{self.entries[self._k - 1][2]}')")
            self.sha.update(piece)
        self._pos += len(mv)

    def __iter__(self):
        while self._k < len(self.entries):
            start, end, name, dtype, shape = self.entries[self._k]
            if start != self._pos or end - start != tensor_nbytes(dtype, shape):
                raise MegatrainError(f"{self.path}: safetensors layout megatrain does not read (tensor '{name}')")
            self._k += 1
            self._current = (name, dtype, shape)
            yield name, dtype, shape
            if self._pos != end:  # the caller did not consume it
                self.skip_to(end)

    def read_into(self, dest: torch.Tensor) -> None:
        name, dtype, shape = self._current
        if dest.dtype != dtype or tuple(dest.shape) != tuple(shape):
            raise MegatrainError(f"{self.path}: tensor '{name}' is {DTYPES.get(dtype, dtype)}{list(shape)}, "
                                 f"expected {DTYPES.get(dest.dtype, dest.dtype)}{list(dest.shape)}")
        self._fill(_bytes(dest))

    def read(self) -> torch.Tensor:
        name, dtype, shape = self._current
        t = torch.empty(shape, dtype=dtype)
        self._fill(_bytes(t))
        return t

    def skip_to(self, end: int) -> None:
        scratch = torch.empty(min(PIECE, max(end - self._pos, 1)), dtype=torch.uint8)
        while self._pos < end:
            n = min(len(scratch), end - self._pos)
            self._fill(_bytes(scratch[:n]))

    def finish(self, expected_sha256: str | None) -> None:
        try:
            rest = self.size - self.file.tell()
            if rest:
                self.skip_to(self._pos + rest)
            if expected_sha256 is not None and self.sha.hexdigest() != expected_sha256:
                raise MegatrainError(f"{self.path}: checksum mismatch (sha256 {self.sha.hexdigest()[:12]}..., the "
                                     f"manifest says {expected_sha256[:12]}...): the file is corrupted")
        finally:
            self.file.close()

    def close(self) -> None:
        self.file.close()


def sha256_file(path: Path) -> tuple[str, int]:
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(PIECE):
            h.update(chunk)
            n += len(chunk)
    return h.hexdigest(), n


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
