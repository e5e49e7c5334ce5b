"""The fast path of a flash checkpoint: copy tensors into a pre-laid-out DCP file, no planning, no pickling.

The first snapshot of a group is an ordinary (collective) DCP save into shared memory, through
`RecordingWriter`, which remembers where in this rank's data file each write item landed. Every
torch.save'd tensor item stores its raw storage bytes uncompressed inside a zip entry `.../data/0`;
`Layout` finds those payload ranges. Later snapshots of the same state layout need no DCP call at
all: each rank keeps the first file's bytes between payloads (zip headers and records, not the
tensors' bytes), maps a file of the same size, copies the current storage bytes of every item into
its range and the few byte items (optimizer hyper-parameters, re-serialized) into theirs;
rank 0 reuses the `.metadata`. The result is byte-for-byte the file DCP would write, so loading
(resharded or not) goes through the ordinary DCP reader.

Anything unexpected (a payload that does not match at build time, a byte item whose size changed,
an item whose storage size changed) makes `fill` return False: the caller falls back to a full DCP
save and rebuilds the layout.
"""
from __future__ import annotations

import io
import mmap
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItemType


class RecordingWriter(FileSystemWriter):
    """FileSystemWriter that keeps this rank's write items and their results (file, offset, length)."""

    def __init__(self, path: str, **kw: Any) -> None:
        super().__init__(path, sync_files=False, **kw)
        self.recorded: list[tuple[Any, Any]] = []

    def write_data(self, plan, planner):
        fut = super().write_data(plan, planner)
        results = {r.index: r for r in fut.wait()}
        self.recorded = [(item, results[item.index]) for item in plan.items]
        return fut


@dataclass
class _Item:
    write_item: Any
    start: int  # where the bytes to overwrite begin in the data file
    length: int
    is_bytes: bool
    crc_at: tuple[int, ...] = ()  # where the file holds this payload's CRC-32 (a torch.save'd tensor's zip records)


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes DCP writes for `t` (its minimal storage), as a uint8 tensor; a view, not a copy, when `t` is
    contiguous (TBE's weights and optimizer states are contiguous slices of one flat buffer)."""
    t = t.detach()
    if t.is_contiguous():
        return t.reshape(-1).view(torch.uint8)  # the storage bytes from the view's offset, in order
    if t.untyped_storage().size() != t.nbytes:
        t = t.clone()  # what DCP does with views: minimal storage
    s = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(s, 0, (s.size(),), (1,))


class _ViewReader(io.RawIOBase):
    """A read-only, seekable file over a memoryview: zipfile reads a payload's headers without the blob copied."""

    def __init__(self, view: memoryview) -> None:
        self.view, self.pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: len(self.view)}[whence] + offset
        return self.pos

    def read(self, n: int | None = -1) -> bytes:
        end = len(self.view) if n is None or n < 0 else min(self.pos + n, len(self.view))
        out = bytes(self.view[self.pos: end])
        self.pos = max(self.pos, end)
        return out


_LOCAL, _CENTRAL, _DESCRIPTOR = b"PK\x03\x04", b"PK\x01\x02", b"PK\x07\x08"


def _payload_range(blob: memoryview) -> tuple[int, int, tuple[int, ...]]:
    """(offset, length) of the raw storage bytes inside one torch.save'd tensor, and where in `blob` the zip records
    hold their CRC-32 (torch's writer: the data descriptor after the payload and the central directory; the local
    header's field is 0): a refilled payload needs each of them rewritten."""
    with zipfile.ZipFile(_ViewReader(blob)) as zf:
        (info,) = [i for i in zf.infolist() if i.filename.endswith("/data/0")]
        start_dir = zf.start_dir
    if info.compress_type != zipfile.ZIP_STORED:
        raise ValueError("torch.save payload is compressed")
    h = info.header_offset
    if blob[h: h + 4] != _LOCAL:
        raise ValueError(f"no local zip header at {h}")
    name_len, extra_len = struct.unpack("<HH", blob[h + 26: h + 30])
    start = h + 30 + name_len + extra_len

    def crc_at(pos: int) -> bool:
        return struct.unpack("<I", blob[pos: pos + 4])[0] == info.CRC

    fields = []
    if crc_at(h + 14):
        fields.append(h + 14)
    elif struct.unpack("<I", blob[h + 14: h + 18])[0] != 0 or not info.flag_bits & 0x08:
        raise ValueError(f"{info.filename}: the local header's CRC-32 is neither the entry's nor deferred")
    if info.flag_bits & 0x08:  # a data descriptor follows the payload: [signature] CRC-32, sizes
        d = start + info.file_size
        d += 4 if blob[d: d + 4] == _DESCRIPTOR else 0
        if not crc_at(d):
            raise ValueError(f"{info.filename}: no CRC-32 in the data descriptor at {d}")
        fields.append(d)
    pos = start_dir
    while blob[pos: pos + 4] == _CENTRAL:
        n, x, c = struct.unpack("<HHH", blob[pos + 28: pos + 34])
        if bytes(blob[pos + 46: pos + 46 + n]) == info.filename.encode():
            if not crc_at(pos + 16):
                raise ValueError(f"{info.filename}: the central directory's CRC-32 is not the entry's")
            fields.append(pos + 16)
        pos += 46 + n + x + c
    if len(fields) < 2:
        raise ValueError(f"{info.filename}: its CRC-32 fields are not where the zip format puts them")
    return start, info.file_size, tuple(fields)


class Layout:
    """One rank's data file of a DCP checkpoint, ready to be refilled with newer values."""

    def __init__(self, directory: Path, recorded: list[tuple[Any, Any]]) -> None:
        files = {res.storage_data.relative_path for _, res in recorded}
        if len(files) > 1:
            raise ValueError(f"expected one data file per rank, got {sorted(files)}")
        self.relative_path = files.pop() if files else None
        directory = Path(directory)
        # the file mapped, not read: on shared memory its pages are the file's own (no copy, no new memory)
        self.buffer: mmap.mmap | bytes = b""
        if self.relative_path is not None and (directory / self.relative_path).stat().st_size:
            with open(directory / self.relative_path, "rb") as f:
                self.buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.size = len(self.buffer)
        # the file in offset order once `keep_headers_only` ran: bytes kept, or (item, True: its CRC-32 / False: its
        # payload) filled in by each `write`
        self.segments: list[bytes | tuple[int, bool]] | None = None
        self.metadata = (directory / ".metadata").read_bytes() if (directory / ".metadata").exists() else None
        self.items: list[_Item] = []
        for item, res in recorded:
            info = res.storage_data
            if info.transform_descriptors:
                raise ValueError("stream transforms are not supported by the flash fast path")
            if item.type == WriteItemType.BYTE_IO:
                self.items.append(_Item(item, info.offset, info.length, True))
            else:
                start, n, crc_at = _payload_range(memoryview(self.buffer)[info.offset: info.offset + info.length])
                self.items.append(_Item(item, info.offset + start, n, False, tuple(info.offset + c for c in crc_at)))

    def sources(self, state_dict: dict[str, Any]) -> list[Any] | None:
        """Every item's current bytes (uint8 tensors / buffers), or None when the layout no longer fits."""
        planner = DefaultSavePlanner()
        planner.set_up_planner(state_dict, is_coordinator=False)
        out: list[Any] = []
        for it in self.items:
            data = planner.resolve_data(it.write_item)  # BYTE_IO items (is_bytes) resolve to a BytesIO
            if isinstance(data, io.BytesIO):
                buf = data.getbuffer()
                if len(buf) != it.length:
                    return None
                out.append(buf)
            else:
                src = _storage_bytes(data)
                if src.numel() != it.length:
                    return None
                out.append(src)
        return out

    def verify(self, state_dict: dict[str, Any]) -> bool:
        """The payload ranges hold exactly the state's bytes (checked once, right after the DCP save), compared in
        place (no copy of either side)."""
        srcs = self.sources(state_dict)
        if srcs is None:
            return False
        data = np.frombuffer(self.buffer, dtype=np.uint8) if self.size else np.empty(0, np.uint8)
        for it, src in zip(self.items, srcs, strict=True):
            have = data[it.start: it.start + it.length]
            want = np.frombuffer(src, dtype=np.uint8) if it.is_bytes else src.numpy()
            if not np.array_equal(have, want):
                return False
        return True

    def keep_headers_only(self) -> None:
        """Drop the payload bytes (the state's own bytes, as large as the rank's shard of the model and optimizer):
        `write` takes them from the state and computes their CRC-32; only the bytes around them are kept."""
        marks = sorted([(it.start, it.length, i, False) for i, it in enumerate(self.items)]
                       + [(c, 4, i, True) for i, it in enumerate(self.items) for c in it.crc_at])
        segments: list[bytes | tuple[int, bool]] = []
        pos = 0
        for start, length, i, is_crc in marks:
            if start < pos:
                raise ValueError(f"overlapping records at byte {start} of {self.relative_path}")
            segments += [bytes(self.buffer[pos: start]), (i, is_crc)]
            pos = start + length
        segments.append(bytes(self.buffer[pos:]))
        if isinstance(self.buffer, mmap.mmap):
            try:
                self.buffer.close()
            except BufferError:  # a view of it is still alive somewhere: the collector unmaps it with the last one
                pass
        self.segments, self.buffer = segments, b""

    def write(self, directory: Path, sources: list[Any], with_metadata: bool) -> None:
        """Write the data file in offset order: the kept bytes, the items' current bytes and their CRC-32s, each byte
        copied once, by `write` calls (the kernel fills the new file's pages; writing through a mapping of a new
        shared-memory file measured 2.3x the CPU, a page fault per 4 KiB)."""
        directory = Path(directory)
        if self.relative_path is not None:
            if self.segments is None:
                self.keep_headers_only()
            assert self.segments is not None
            views = [src if it.is_bytes else memoryview(src.numpy()) for it, src in zip(self.items, sources,
                                                                                         strict=True)]
            crcs: dict[int, bytes] = {}
            with open(directory / self.relative_path, "wb", buffering=0) as f:
                for seg in self.segments:
                    if isinstance(seg, bytes):
                        _write_all(f, seg)
                        continue
                    i, is_crc = seg
                    if not is_crc:
                        _write_all(f, views[i])
                        continue
                    if i not in crcs:
                        crcs[i] = struct.pack("<I", zlib.crc32(views[i]))
                    _write_all(f, crcs[i])
                if f.tell() != self.size:
                    raise OSError(f"flash snapshot {directory / self.relative_path}: wrote {f.tell()} bytes, "
                                  f"the layout has {self.size}")
        if with_metadata and self.metadata is not None:
            (directory / ".metadata").write_bytes(self.metadata)


def _write_all(f: Any, data: Any) -> None:
    """`f.write` until every byte of `data` is written (a raw file may take fewer bytes per call)."""
    view = memoryview(data).cast("B")
    while len(view):
        n = f.write(view)
        if not n:
            raise OSError(f"no progress writing {f.name}")
        view = view[n:]
