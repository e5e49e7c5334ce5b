"""`recforge bench train_peer`'s logic at small sizes: configurations the machine cannot hold are refused before
anything runs (naming the limit), the reference's transform and batches, and the report's medians and ratios."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("train_peer")


def test_refuses_what_the_machine_cannot_hold(bench, capsys):
    with pytest.raises(bench.ConfigRefused, match=r"os.cpu_count\(\) = 2"):
        bench.check_machine(1000, 100, 2, 2, cpus=2, available_bytes=2**40)
    with pytest.raises(bench.ConfigRefused, match=r"psutil.virtual_memory\(\).available = 1.0 GiB"):
        bench.check_machine(10_000_000, 100, 2, 1, cpus=2, available_bytes=2**30)
    with pytest.raises(bench.ConfigRefused, match="must be >= 1"):
        bench.check_machine(0, 100, 2, 1, cpus=2, available_bytes=2**40)
    assert bench.check_machine(1000, 100, 2, 1, cpus=2, available_bytes=2**40)["cpus"] == 2
    # the command line refuses before generating anything
    assert bench.main(["--rows", "1000", "--workers", str(10_000), "--out", "/nonexistent/x.json"]) == 2
    assert "refused" in capsys.readouterr().err


def test_reference_transform_and_batches():
    from recforge.config import DatasetConfig, DenseFeature, SparseFeature
    from recforge.preprocess.synth import random_raw_batch
    from train_peer.reference import to_batches, transform

    ds = DatasetConfig(name="t", dense=[DenseFeature(name="I1")],
                       sparse=[SparseFeature(name="C1", cardinality=50), SparseFeature(name="C2", cardinality=9)])
    raw = random_raw_batch(ds, 10, seed=3)
    rows = transform(raw, [7, 5])
    expected = torch.log(raw.dense.double().clamp(min=-2) + 3).float()
    torch.testing.assert_close(rows.dense, expected)
    assert bool((rows.ids[:, 0] < 7).all()) and bool((rows.ids[:, 1] < 5).all()) and bool((rows.ids >= 0).all())
    assert torch.equal(rows.ids[:, 1], torch.remainder(raw.sparse[:, 1], 5))
    # 2 ranks x batch 2: global steps of 4 rows (the last 2 rows dropped); rank 1 takes rows 2-3 of step 0
    b = to_batches(rows, ["C1", "C2"], 2, rank=1, world=2)
    assert len(b) == 2
    torch.testing.assert_close(b[0].labels, rows.labels[2:4])
    assert b[0].sparse_features.keys() == ["C1", "C2"]
    assert torch.equal(b[0].sparse_features["C2"].values(), rows.ids[2:4, 1])


def test_summary_medians_and_ratios(bench):
    def side(sps, auc, fwd):
        return {"samples_per_s": sps, "heldout_auc": auc,
                "phases": [{"steps": 10, "forward_s": fwd, "data_s": 0.1, "train_wall_s": 9.0,
                            "prefetch_thread_s": {"build": 0.5}}] * 2}

    rounds = [{"recforge": side(s, 0.77, 0.2), "reference": side(r, 0.76, 0.3), "recforge_sync": side(q, 0.77, 0.2)}
              for s, r, q in [(100.0, 90.0, 80.0), (120.0, 100.0, 85.0), (110.0, 95.0, 90.0)]]
    out = bench.summarize(rounds)
    assert out["median"]["recforge"]["samples_per_s"] == 110.0
    assert out["ratio_samples_per_s"] == pytest.approx(110.0 / 95.0)
    assert out["ratio_prefetch_vs_sync"] == pytest.approx(110.0 / 85.0)
    assert out["auc_difference"] == pytest.approx(0.01)
    step = out["median"]["recforge"]["step_ms"]
    assert step["forward"] == pytest.approx(20.0) and step["thread_build"] == pytest.approx(50.0)
    assert "train_wall" not in step and "prefetch_thread" not in step


def test_allocator_sides_are_summarized_against_recforge(bench):
    def side(sps):
        return {"samples_per_s": sps, "heldout_auc": 0.77, "phases": [{"steps": 10, "forward_s": 0.2}]}

    rounds = [{"recforge": side(s), "recforge_system_alloc": side(a), "reference_kept_alloc": side(k)}
              for s, a, k in [(100.0, 80.0, 120.0), (110.0, 100.0, 130.0)]]
    out = bench.summarize(rounds)
    assert out["ratio_kept_vs_system_alloc"] == pytest.approx(105.0 / 90.0)
    assert out["ratio_vs_reference_kept_alloc"] == pytest.approx(105.0 / 125.0)
    assert bench.SIDE_ENV["recforge_system_alloc"] == {"RECFORGE_ALLOCATOR": "system"}
    assert "RECFORGE_ALLOCATOR" in bench.JOB_ENV  # cleared for the other sides


def test_the_torchrec_model_side_is_recforge_without_its_fused_interaction(bench):
    """recforge_torchrec_model trains torchrec's DLRM modules (the reference's model) in recforge's loop; its ratio is
    recforge's over it; the reference builds torchrec's stock DLRM."""
    from torchrec.models.dlrm import InteractionArch, SparseArch

    from recforge.config import ModelConfig, TrainConfig
    from train_peer.reference import torchrec_dlrm

    def side(sps):
        return {"samples_per_s": sps, "heldout_auc": 0.77, "phases": [{"steps": 10, "forward_s": 0.2}]}

    rounds = [{"recforge": side(s), "recforge_torchrec_model": side(t)} for s, t in [(115.0, 100.0), (120.0, 100.0)]]
    assert bench.summarize(rounds)["ratio_fused_vs_torchrec_model"] == pytest.approx(117.5 / 100.0)
    stock = TrainConfig(**bench.SIDE_TRAIN["recforge_torchrec_model"])
    assert not (stock.fused_interaction or stock.rowwise_adagrad_kernel or stock.dense_grad_exchange)
    default = TrainConfig()  # recforge's side
    assert default.fused_interaction and default.rowwise_adagrad_kernel and default.dense_grad_exchange
    assert TrainConfig(**bench.SIDE_TRAIN["recforge_fbgemm_update"]).rowwise_adagrad_kernel is False
    assert TrainConfig(**bench.SIDE_TRAIN["recforge_allreduce"]).dense_grad_exchange is False
    assert ("ratio_kernel_vs_fbgemm_update", "recforge", "recforge_fbgemm_update") in bench.RATIOS
    assert ("ratio_exchange_vs_allreduce", "recforge", "recforge_allreduce") in bench.RATIOS
    model = torchrec_dlrm(ModelConfig(), [("C1", 10), ("C2", 5)], 3)
    assert type(model.inter_arch) is InteractionArch and type(model.sparse_arch) is SparseArch
