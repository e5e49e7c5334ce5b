"""The fast path of a flash checkpoint: copy tensors into a pre-laid-out DCP file, no planning, no pickling.

The first snapshot of a group is an ordinary (collective) DCP save into shared memory, through
`RecordingWriter`, which remembers where in this rank's data file each write item landed. Every
torch.save'd tensor item stores its raw storage bytes uncompressed inside a zip entry `.../data/0`;
`Layout` finds those payload ranges. Later snapshots of the same state layout need no DCP call at
all: each rank fills a reusable buffer (the first file's bytes) with the current storage bytes of
every item, re-serializes the few byte items (optimizer hyper-parameters) in place, and writes it;
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.untyped_storage().size() != t.nbytes:
        t = t.clone()  # what DCP does with views: minimal storage
    s = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(s, 0, (s.size(),), (1,))


def _payload_range(blob: bytes) -> tuple[int, int]:
    """(offset, length) of the raw storage bytes inside one torch.save'd tensor."""
    with zipfile.ZipFile(io.BytesIO(blob)) as zf:
        (info,) = [i for i in zf.infolist() if i.filename.endswith("/data/0")]
    if info.compress_type != zipfile.ZIP_STORED:
        raise ValueError("torch.save payload is compressed")
    name_len, extra_len = struct.unpack("<HH", blob[info.header_offset + 26: info.header_offset + 30])
    return info.header_offset + 30 + name_len + extra_len, info.file_size


class Layout:
    """One rank's data file of a DCP checkpoint, ready to be refilled with newer values."""

    def __init__(self, directory: Path, recorded: list[tuple[Any, Any]]) -> None:
        files = {res.storage_data.relative_path for _, res in recorded}
        if len(files) > 1:
            raise ValueError(f"expected one data file per rank, got {sorted(files)}")
        self.relative_path = files.pop() if files else None
        directory = Path(directory)
        self.buffer = bytearray((directory / self.relative_path).read_bytes()) if self.relative_path else bytearray()
        self.metadata = (directory / ".metadata").read_bytes() if (directory / ".metadata").exists() else None
        self.items: list[_Item] = []
        for item, res in recorded:
            info = res.storage_data
            if info.transform_descriptors:
                raise ValueError("stream transforms are not supported by the flash fast path")
            if item.type == WriteItemType.BYTE_IO:
                self.items.append(_Item(item, info.offset, info.length, True))
            else:
                start, n = _payload_range(bytes(self.buffer[info.offset: info.offset + info.length]))
                self.items.append(_Item(item, info.offset + start, n, False))

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
        """The payload ranges hold exactly the state's bytes (checked once, right after the DCP save)."""
        srcs = self.sources(state_dict)
        if srcs is None:
            return False
        for it, src in zip(self.items, srcs, strict=True):
            want = bytes(src) if it.is_bytes else src.cpu().numpy().tobytes()
            if bytes(self.buffer[it.start: it.start + it.length]) != want:
                return False
        return True

    def write(self, directory: Path, sources: list[Any], with_metadata: bool) -> None:
        """Write the data file: the recorded bytes between items, the items' current bytes in place,
        each byte copied once (straight into the mapped file)."""
        directory = Path(directory)
        if self.relative_path is not None:
            path = directory / self.relative_path
            with open(path, "w+b") as f:
                f.truncate(len(self.buffer))
                if self.buffer:
                    with mmap.mmap(f.fileno(), len(self.buffer)) as mm:
                        pos = 0
                        for it, src in sorted(zip(self.items, sources, strict=True), key=lambda x: x[0].start):
                            mm[pos: it.start] = self.buffer[pos: it.start]
                            if it.is_bytes:
                                mm[it.start: it.start + it.length] = src
                            else:
                                torch.frombuffer(mm, dtype=torch.uint8, count=it.length, offset=it.start).copy_(src)
                            pos = it.start + it.length
                        mm[pos:] = self.buffer[pos:]
        if with_metadata and self.metadata is not None:
            (directory / ".metadata").write_bytes(self.metadata)
