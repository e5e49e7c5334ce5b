"""Synthetic Criteo-format day files with a hidden, learnable click model.

Sparse ids follow a Zipf-like law behind a per-column keyed permutation, dense values are zero-inflated
log-normal counts, and labels come from a logistic model of both, calibrated to the dataset's positive rate. The
hidden model depends only on (dataset, seed, cardinality scale), so days differ but a model trained on one
transfers to the next; the report gives each day's Bayes ceiling (AUC). Design: docs/architecture.md#synthetic-data.
"""
from __future__ import annotations

import gzip as gzip_mod
import io
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
from pydantic import BaseModel

from recforge.config import DatasetConfig
from recforge.data.binned_auc import StreamingAuc

CHUNK_ROWS = 65536
EXACT_CARDINALITY = 10_000  # columns at most this large keep their exact cardinality
TOP_EFFECT_RANKS = 300
LOGIT_STD = 1.3  # spread of the hidden logit; sets the Bayes AUC (about 0.78-0.79 at 25% positives)
CALIBRATION_ROWS = 16384
DENSE_CAP = 10**9
# byte value -> its two lowercase hex digits, as a uint16 whose memory holds them in order
_HEX_DIGITS = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
_BYTE_TO_HEX = (np.stack([_HEX_DIGITS[np.arange(256) >> 4], _HEX_DIGITS[np.arange(256) & 15]], axis=1)
                .copy().view(np.uint16).ravel())
_WRITE_OPTS = pacsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")


class GeneratorReport(BaseModel):
    dataset: str
    seed: int
    files: list[str]
    rows_per_day: list[int]
    positive_rate: list[float]
    bayes_auc: list[float]
    cardinality_scale: float
    id_space: dict[str, int]  # distinct raw values each sparse column can take


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """ROC AUC by ranks (Mann-Whitney U), ties counted half."""
    labels = np.asarray(labels).astype(bool)
    scores = np.asarray(scores, dtype=np.float64)
    n_pos = int(labels.sum())
    n_neg = labels.size - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError("auc: needs both positive and negative labels")
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    # average rank (1-based) of each group of tied scores
    boundaries = np.flatnonzero(np.diff(sorted_scores)) + 1
    starts = np.concatenate(([0], boundaries))
    ends = np.concatenate((boundaries, [scores.size]))
    avg_rank = (starts + ends + 1) / 2.0
    ranks = np.empty(scores.size)
    ranks[order] = np.repeat(avg_rank, ends - starts)
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def _cardinalities(dataset: DatasetConfig) -> list[int]:
    """Each sparse column's cardinality; synthetic data needs them all."""
    unknown = [f.name for f in dataset.sparse if f.cardinality is None]
    if unknown:
        raise ValueError(f"generate_days: columns {unknown} have no cardinality; synthetic data needs one per column")
    return [int(f.cardinality or 0) for f in dataset.sparse]


def default_cardinality_scale(dataset: DatasetConfig, total_rows: int) -> float:
    """Scale so that the largest column has at most about `total_rows` distinct values."""
    largest = max(_cardinalities(dataset))
    return min(1.0, total_rows / largest)


def id_space(cardinality: int, scale: float) -> int:
    if cardinality <= EXACT_CARDINALITY:
        return cardinality
    return max(EXACT_CARDINALITY, int(round(cardinality * scale)))


@dataclass
class _HiddenModel:
    k: np.ndarray  # [S] id space per sparse column
    zipf_a: np.ndarray  # [S]
    keys: np.ndarray  # [S, 4] uint32 bijection keys (two odd multipliers, two addends)
    effects: list[np.ndarray]  # per sparse column: [top ranks..., tail, missing]
    dense_mu: np.ndarray
    dense_sd: np.ndarray
    dense_p0: np.ndarray
    dense_w_log: np.ndarray  # [D], zero for columns without a term
    dense_w_pos: np.ndarray
    dense_center: np.ndarray
    bias: float = 0.0


def _build_model(dataset: DatasetConfig, seed: int, scale: float) -> _HiddenModel:
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(0,)))
    n_s, n_d = len(dataset.sparse), len(dataset.dense)
    k = np.array([id_space(c, scale) for c in _cardinalities(dataset)], dtype=np.int64)
    zipf_a = rng.uniform(1.05, 1.25, n_s)
    keys = rng.integers(0, 2**32, size=(n_s, 4), dtype=np.uint64).astype(np.uint32)
    keys[:, :2] |= 1
    strength = rng.gamma(0.8, 1.0, n_s)
    effects = []
    for j in range(n_s):
        top = min(int(k[j]), TOP_EFFECT_RANKS)
        eff = np.empty(top + 2)
        eff[:top] = rng.normal(0.0, strength[j], top)
        eff[top] = rng.normal(0.0, 0.25 * strength[j])  # the tail shares one small effect
        eff[top + 1] = rng.normal(0.0, 0.3 * strength[j])  # missing
        effects.append(eff)
    dense_mu = rng.uniform(0.5, 4.5, n_d)
    dense_sd = rng.uniform(0.6, 1.6, n_d)
    dense_p0 = rng.uniform(0.05, 0.35, n_d)
    w_log = np.zeros(n_d)
    w_pos = np.zeros(n_d)
    informative = rng.permutation(n_d)[: min(3, n_d)]
    w_log[informative] = rng.normal(0.0, 0.5, informative.size)
    w_pos[informative] = rng.normal(0.0, 0.5, informative.size)
    model = _HiddenModel(k, zipf_a, keys, effects, dense_mu, dense_sd, dense_p0, w_log, w_pos, dense_mu.copy())

    # calibration: fix the logit spread, then solve the bias for the positive rate
    cal = _draw(dataset, model, rng, CALIBRATION_ROWS)[-1]
    spread = float(cal.std())
    factor = LOGIT_STD / spread if spread > 0 else 1.0
    model.effects = [e * factor for e in model.effects]
    model.dense_w_log *= factor
    model.dense_w_pos *= factor
    z = (cal - cal.mean()) * factor
    lo, hi = -30.0, 30.0
    for _ in range(80):
        mid = (lo + hi) / 2
        if _sigmoid(z + mid).mean() < dataset.positive_rate:
            lo = mid
        else:
            hi = mid
    model.bias = (lo + hi) / 2 - float(cal.mean()) * factor
    return model


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _permute_ids(ranks: np.ndarray, key: np.ndarray) -> np.ndarray:
    """A keyed bijection of uint32: distinct ranks give distinct 32-bit raw values."""
    x = ranks.astype(np.uint32)
    x = x * key[0] + key[2]
    x ^= x >> np.uint32(15)
    x = x * key[1]
    x ^= x >> np.uint32(13)
    x += key[3]
    return x


def _draw(dataset: DatasetConfig, model: _HiddenModel, rng: np.random.Generator, n: int):
    """-> dense [D, n] int64, dense_missing, sparse raw [S, n] uint32, sparse_missing, logit [n] (with bias)."""
    n_s, n_d = len(dataset.sparse), len(dataset.dense)
    z = np.full(n, model.bias)
    dense = np.zeros((n_d, n), dtype=np.int64)
    dense_missing = np.zeros((n_d, n), dtype=bool)
    for j, feat in enumerate(dataset.dense):
        counts = np.floor(np.exp(rng.normal(model.dense_mu[j], model.dense_sd[j], n)))
        x = np.minimum(counts, DENSE_CAP).astype(np.int64)
        x[rng.random(n) < model.dense_p0[j]] = 0
        if feat.name == "I2":  # Criteo's I2 takes small negative values
            u = rng.random(n)
            x[u < 0.08] = -1
            x[u < 0.01] = -2
        miss = rng.random(n) < feat.missing_rate
        dense[j] = x
        dense_missing[j] = miss
        if model.dense_w_log[j] or model.dense_w_pos[j]:
            logx = np.log1p(np.maximum(x, 0)) - model.dense_center[j]
            term = model.dense_w_log[j] * logx + model.dense_w_pos[j] * (x > 0)
            z += np.where(miss, 0.0, term)
    sparse = np.zeros((n_s, n), dtype=np.uint32)
    sparse_missing = np.zeros((n_s, n), dtype=bool)
    for j, sparse_feat in enumerate(dataset.sparse):
        k, a = float(model.k[j]), model.zipf_a[j]
        u = rng.random(n)
        x = (1.0 - u * (1.0 - (k + 1.0) ** (1.0 - a))) ** (1.0 / (1.0 - a))
        ranks = np.minimum(x.astype(np.int64) - 1, int(k) - 1)
        miss = rng.random(n) < sparse_feat.missing_rate
        eff = model.effects[j]
        top = eff.size - 2
        idx = np.where(miss, top + 1, np.minimum(ranks, top))
        z += eff[idx]
        sparse[j] = _permute_ids(ranks, model.keys[j])
        sparse_missing[j] = miss
    return dense, dense_missing, sparse, sparse_missing, z


def _hex_column(values: np.ndarray, missing: np.ndarray) -> pa.Array:
    """8-digit lowercase hex strings (empty where missing) built from a byte lookup table."""
    present = ~missing
    big_endian = values[present].astype(">u4").view(np.uint8)
    chars = _BYTE_TO_HEX[big_endian].view(np.uint8)
    offsets = np.zeros(values.size + 1, dtype=np.int32)
    np.cumsum(present.astype(np.int32) * 8, out=offsets[1:])
    return pa.Array.from_buffers(pa.string(), values.size, [None, pa.py_buffer(offsets), pa.py_buffer(chars)])


def _format_chunk(dataset: DatasetConfig, labels, dense, dense_missing, sparse, sparse_missing) -> bytes:
    arrays = [pa.array(labels.astype(np.int8))]
    arrays += [pa.array(x, mask=m) for x, m in zip(dense, dense_missing, strict=True)]
    arrays += [_hex_column(x, m) for x, m in zip(sparse, sparse_missing, strict=True)]
    names = [dataset.label, *dataset.dense_names, *dataset.sparse_names]
    sink = io.BytesIO()
    pacsv.write_csv(pa.Table.from_arrays(arrays, names=names), sink, _WRITE_OPTS)
    return sink.getvalue()


def generate_days(
    dataset: DatasetConfig,
    out_dir: str | Path,
    *,
    days: int,
    rows_per_day: int,
    seed: int,
    gzip: bool = False,
    cardinality_scale: float | None = None,
    first_day: int = 0,
) -> GeneratorReport:
    """Write out_dir/day_0.tsv .. day_{days-1}.tsv (".tsv.gz" with gzip), each via temp file + rename.

    The hidden model depends on `seed` only; file i holds the rows of calendar day `first_day + i`, so runs for
    consecutive dates share the model and overlap in the days they draw (a sliding window of a daily stream)."""
    if first_day < 0:
        raise ValueError(f"generate_days: first_day must be >= 0, got {first_day}")
    if not dataset.is_criteo_layout:
        raise ValueError(f"generate_days: dataset {dataset.name!r} is not in the Criteo layout (label 0/1 first, "
                         "int dense, hex32 categoricals, tsv without header): the generator writes only that layout")
    _cardinalities(dataset)
    if days < 1:
        raise ValueError(f"generate_days: days must be >= 1, got {days}")
    if rows_per_day < 1:
        raise ValueError(f"generate_days: rows_per_day must be >= 1, got {rows_per_day}")
    if cardinality_scale is None:
        cardinality_scale = default_cardinality_scale(dataset, rows_per_day * days)
    if not 0.0 < cardinality_scale <= 1.0:
        raise ValueError(f"generate_days: cardinality_scale must be in (0, 1], got {cardinality_scale}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = _build_model(dataset, seed, cardinality_scale)
    files, rates, aucs = [], [], []
    for day in range(days):
        rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(1, first_day + day)))
        path = out_dir / (f"day_{day}.tsv" + (".gz" if gzip else ""))
        tmp = out_dir / f".{path.name}.tmp-{os.getpid()}"
        scored = StreamingAuc()  # the day's Bayes AUC, without holding its probabilities
        try:
            with open(tmp, "wb") as raw:
                out = gzip_mod.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=1, mtime=0) if gzip else raw
                for start in range(0, rows_per_day, CHUNK_ROWS):
                    n = min(CHUNK_ROWS, rows_per_day - start)
                    dense, dmiss, sparse, smiss, z = _draw(dataset, model, rng, n)
                    p = _sigmoid(z)
                    labels = rng.random(n) < p
                    out.write(_format_chunk(dataset, labels, dense, dmiss, sparse, smiss))
                    scored.update(labels, p)
                if gzip:
                    out.close()
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        positives = int(scored.pos.sum())
        files.append(str(path))
        rates.append(positives / rows_per_day)
        aucs.append(scored.auc() if 0 < positives < rows_per_day else float("nan"))
    return GeneratorReport(
        dataset=dataset.name,
        seed=seed,
        files=files,
        rows_per_day=[rows_per_day] * days,
        positive_rate=rates,
        bayes_auc=aucs,
        cardinality_scale=cardinality_scale,
        id_space={f.name: int(k) for f, k in zip(dataset.sparse, model.k, strict=True)},
    )
