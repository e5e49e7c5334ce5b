"""Manifest of an ingested dataset: the shards, their checksums and row counts, where they came from."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from recforge.config import DatasetConfig
from recforge.data.errors import DataError

MANIFEST_NAME = "manifest.json"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ShardInfo(_Strict):
    path: str = Field(description="relative to the manifest directory")
    rows: int = Field(ge=0)
    bytes: int = Field(ge=0)
    sha256: str


class SourceStats(_Strict):
    path: str
    rows: int = Field(ge=0, description="valid rows ingested")
    quarantined_rows: int = Field(ge=0)
    rows_by_day: dict[str, int] = Field(default_factory=dict, description="valid rows per UTC day "
                                        "(YYYY-MM-DD) of the dataset's timestamp column; empty without one")


class Manifest(_Strict):
    dataset: DatasetConfig
    shards: list[ShardInfo]
    total_rows: int = Field(ge=0)
    quarantined_rows: int = Field(ge=0)
    sources: list[str]
    source_stats: list[SourceStats] = Field(default_factory=list)
    rows_by_day: dict[str, int] = Field(default_factory=dict, description="valid rows per UTC day (YYYY-MM-DD) "
                                        "of the timestamp column over all sources; empty without one")

    _dir: Path | None = PrivateAttr(default=None)

    @property
    def dir(self) -> Path:
        if self._dir is None:
            raise ValueError("manifest has no directory yet: use Manifest.load(dir) or .save(dir)")
        return self._dir

    @classmethod
    def load(cls, directory: str | Path) -> Manifest:
        directory = Path(directory)
        path = directory / MANIFEST_NAME
        if not path.is_file():
            raise FileNotFoundError(f"manifest not found: {path}")
        manifest = cls.model_validate_json(path.read_text())
        manifest._dir = directory
        return manifest

    def save(self, directory: str | Path) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / MANIFEST_NAME
        tmp = directory / f".{MANIFEST_NAME}.tmp-{os.getpid()}"
        tmp.write_text(self.model_dump_json(indent=2) + "\n")
        os.replace(tmp, path)
        self._dir = directory
        return path

    def shard_path(self, i: int) -> Path:
        if not 0 <= i < len(self.shards):
            raise IndexError(f"shard index {i} out of range: the manifest has {len(self.shards)} shards")
        return self.dir / self.shards[i].path

    def verify(self) -> None:
        """Check every shard's size, sha256 and row count, and the totals; raise DataError naming the shard."""
        for i, shard in enumerate(self.shards):
            path = self.shard_path(i)
            if not path.is_file():
                raise DataError(f"shard {i} ({shard.path}) is missing: {path}")
            size = path.stat().st_size
            if size != shard.bytes:
                raise DataError(f"shard {i} ({shard.path}) has {size} bytes, manifest says {shard.bytes}")
            digest = file_sha256(path)
            if digest != shard.sha256:
                raise DataError(f"shard {i} ({shard.path}) checksum mismatch: sha256 {digest}, "
                                f"manifest says {shard.sha256}")
            try:
                rows = pq.ParquetFile(path).metadata.num_rows
            except Exception as exc:  # checksum matched, so this means the manifest itself was written wrong
                raise DataError(f"shard {i} ({shard.path}) is not readable Parquet: {exc}") from exc
            if rows != shard.rows:
                raise DataError(f"shard {i} ({shard.path}) has {rows} rows, manifest says {shard.rows}")
        total = sum(s.rows for s in self.shards)
        if total != self.total_rows:
            raise DataError(f"manifest total_rows is {self.total_rows} but its shards hold {total} rows")


def shard_rows_from_manifest(manifest_dir: str | Path) -> list[int]:
    """Row counts of a data manifest's shards (`manifest.json`: shards[*].rows), read as plain JSON: what a job
    master or a profiler needs to split the data into tasks, without validating the whole manifest."""
    path = Path(manifest_dir) / MANIFEST_NAME
    if not path.exists():
        raise FileNotFoundError(f"manifest not found: {path}")
    data = json.loads(path.read_text())
    try:
        rows = [int(s["rows"]) for s in data["shards"]]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: expected shards[*].rows integers ({e!r})") from e
    return rows


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
