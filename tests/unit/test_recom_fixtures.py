"""Shared builders for the recforge.recom tests (no tests here): a small dataset, the real RAP plan and
PreprocessModule, torchrec DLRM / DLRM_DCN over one table per sparse feature, and raw batches with nulls."""
from __future__ import annotations

import torch
from torchrec.models.dlrm import DLRM, DLRM_DCN
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from recforge.config import DatasetConfig, DenseFeature, ModelConfig, SparseFeature
from recforge.preprocess.module import PreprocessModule
from recforge.preprocess.planning.plan import FeaturePlan, OpSpec, Plan, criteo_plan
from recforge.recom.inference import InferenceModule
from recforge.train.model import build_dlrm

EMBED_DIM = 8


def small_dataset(num_dense: int = 4, num_sparse: int = 6) -> DatasetConfig:
    cards = [3, 40, 1000, 7, 100000, 25, 600, 12]
    return DatasetConfig(
        name="recom_test",
        dense=[DenseFeature(name=f"I{i + 1}", missing_rate=0.3) for i in range(num_dense)],
        sparse=[SparseFeature(name=f"C{i + 1}", cardinality=cards[i % len(cards)], missing_rate=0.3)
                for i in range(num_sparse)],
    )


def make_dlrm(arch: str, tables: list[tuple[str, int]], num_dense: int, *, reverse_tables: bool = False,
              pooling: PoolingType = PoolingType.SUM, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    configs = [EmbeddingBagConfig(name=f"t_{name}", embedding_dim=EMBED_DIM, num_embeddings=rows,
                                  feature_names=[name], pooling=pooling) for name, rows in tables]
    if reverse_tables:
        configs = configs[::-1]
    ebc = EmbeddingBagCollection(tables=configs)
    if arch == "dlrm":
        model = DLRM(ebc, num_dense, [16, EMBED_DIM], [16, 8, 1])
    elif arch == "dlrm_dcn":
        model = DLRM_DCN(ebc, num_dense, [16, EMBED_DIM], [16, 8, 1], dcn_num_layers=2, dcn_low_rank_dim=4)
    else:
        raise ValueError(arch)
    return model.eval()


def model_config(arch: str) -> ModelConfig:
    return ModelConfig(arch=arch, embedding_dim=EMBED_DIM, dense_arch=[16, EMBED_DIM], over_arch=[16, 8, 1],
                       dcn_num_layers=2, dcn_low_rank_dim=4)


def build_inference(arch: str = "dlrm", *, dataset: DatasetConfig | None = None, plan: Plan | None = None,
                    table_cap: int = 50, seed: int = 0, **dlrm_kwargs) -> InferenceModule:
    """The platform's own pieces: criteo_plan -> PreprocessModule, and train.model.build_dlrm (or, when
    ``dlrm_kwargs`` ask for a table order / pooling build_dlrm does not make, torchrec's DLRM directly)."""
    dataset = dataset or small_dataset()
    plan = plan or criteo_plan(dataset, table_cap)
    pre = PreprocessModule(plan, dataset)
    if dlrm_kwargs:
        dlrm = make_dlrm(arch, plan.tables(), len(plan.dense_features()), seed=seed, **dlrm_kwargs)
    else:
        torch.manual_seed(seed)
        dlrm = build_dlrm(model_config(arch), plan.tables(), len(plan.dense_features()), "cpu")
    return InferenceModule(pre, dlrm).eval()


def plan_with_firstx(dataset: DatasetConfig, x: int | None, table_cap: int = 50) -> Plan:
    """criteo_plan, but the sparse chains end with firstx(x) (or have no firstx when x is None)."""
    base = criteo_plan(dataset, table_cap)
    feats = []
    for f in base.features:
        if f.kind == "sparse":
            ops = [o for o in f.ops if o.op != "firstx"]
            if x is not None:
                ops.append(OpSpec(op="firstx", params={"X": x}))
            f = FeaturePlan(name=f.name, kind=f.kind, source=f.source, ops=ops)
        feats.append(f)
    return Plan(name=f"firstx_{x}", features=feats)


def raw_batch(dataset: DatasetConfig, rows: int, seed: int, null_rate: float = 0.3) -> tuple[torch.Tensor, ...]:
    """(dense int64, dense_valid bool, sparse int64, sparse_valid bool); nulls hold 0 with valid False."""
    g = torch.Generator().manual_seed(seed)
    fd, fs = len(dataset.dense), len(dataset.sparse)
    dense_valid = torch.rand(rows, fd, generator=g) >= null_rate
    sparse_valid = torch.rand(rows, fs, generator=g) >= null_rate
    dense = torch.randint(-3, 50, (rows, fd), generator=g) * dense_valid
    sparse = torch.randint(0, 1 << 32, (rows, fs), generator=g) * sparse_valid
    return dense, dense_valid, sparse, sparse_valid
