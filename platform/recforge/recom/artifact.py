"""One file per compiled model.

* Without a fused layer: the captured program as torch.export writes it (a .pt2 archive), metadata in
  its extra files (the foundation's format; still loaded).
* With one: an uncompressed zip holding ``recom_format`` (a marker), ``metadata.json``, ``dense.pt2``
  (the residual program, torch.export format), ``layer.pt`` (the packed tables, boundaries and
  column metadata, torch.save) and ``layer.json`` / ``in_spec.json`` (how inputs map to the op).
Written to a temp file in the target directory and renamed, so a reader never sees half a file.
"""
from __future__ import annotations

import io
import json
import os
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from recforge.recom.backend.layer import FusedEmbeddingLayer

FORMAT = "recforge.recom/1"
_META_FILE = "recom_metadata.json"  # inside a plain .pt2 (foundation format)


def _json_safe(meta: dict[str, Any]) -> str:
    return json.dumps(meta, default=str)


def _atomic(path: Path, write) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def save_compiled(compiled, path: str | os.PathLike) -> Path:
    path = Path(path)
    meta = dict(compiled.metadata)
    if compiled.layer is None:
        if compiled.in_spec is not None:
            meta["in_spec"] = pytree.treespec_dumps(compiled.in_spec)
            meta["input_names"] = compiled.input_names
        return _atomic(path, lambda tmp: torch.export.save(compiled.exported_program, tmp,
                                                           extra_files={_META_FILE: _json_safe(meta)}))

    def write(tmp: str) -> None:
        dense = io.BytesIO()
        torch.export.save(compiled.exported_program, dense)
        layer = compiled.layer
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            zf.writestr("recom_format", FORMAT)
            zf.writestr("metadata.json", _json_safe(meta))
            zf.writestr("in_spec.json", pytree.treespec_dumps(compiled.in_spec))
            zf.writestr("out_spec.json", pytree.treespec_dumps(compiled.out_spec))
            zf.writestr("layer.json", json.dumps({**layer.config(), "dense_index": compiled.dense_index,
                                                   "input_names": compiled.input_names}))
            zf.writestr("dense.pt2", dense.getvalue())
            with zf.open("layer.pt", "w", force_zip64=True) as f:
                torch.save({k: getattr(layer, k) for k in ("weights", "fbuf", "ibuf", "meta")}, f)

    return _atomic(path, write)


def is_recom_archive(path: Path) -> bool:
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as zf:
        return "recom_format" in zf.namelist()


def load_compiled(path: str | os.PathLike, backend: str | None = None):
    # load-order knot: recforge.recom.compile imports this module (save / load) at its top
    from recforge.recom.compile import DEFAULT_BACKEND, CompiledModel  # lazy: load-order knot (above)

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"compiled model not found: {path}")
    if not is_recom_archive(path):
        extra = {_META_FILE: ""}
        ep = torch.export.load(path, extra_files=extra)
        meta = json.loads(extra[_META_FILE]) if extra[_META_FILE] else {}
        in_spec = pytree.treespec_loads(meta.pop("in_spec")) if "in_spec" in meta else None
        return CompiledModel(ep, backend=backend or meta.get("requested_backend", DEFAULT_BACKEND), metadata=meta,
                             in_spec=in_spec, input_names=meta.pop("input_names", None))
    with zipfile.ZipFile(path) as zf:
        fmt = zf.read("recom_format").decode()
        if fmt != FORMAT:
            raise ValueError(f"{path}: format {fmt!r}, this recforge reads {FORMAT!r}")
        meta = json.loads(zf.read("metadata.json"))
        in_spec = pytree.treespec_loads(zf.read("in_spec.json").decode())
        out_spec = pytree.treespec_loads(zf.read("out_spec.json").decode())
        cfg = json.loads(zf.read("layer.json"))
        ep = torch.export.load(io.BytesIO(zf.read("dense.pt2")))
        with zf.open("layer.pt") as f:
            bufs = torch.load(io.BytesIO(f.read()), weights_only=True)
    layer = FusedEmbeddingLayer(bufs["weights"], bufs["fbuf"], bufs["ibuf"], bufs["meta"], cfg["total_dim"],
                                cfg["input_index"], cfg["batch_index"], cfg["column_names"])
    return CompiledModel(ep, backend=backend or meta.get("requested_backend", DEFAULT_BACKEND), metadata=meta,
                         layer=layer, in_spec=in_spec, dense_index=cfg["dense_index"],
                         input_names=cfg["input_names"], out_spec=out_spec, onednn=bool(meta.get("onednn", False)))
