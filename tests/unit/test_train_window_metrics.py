"""Windowed training quality (AUC / logloss / NE) equals the metrics computed on the window's real rows."""
import numpy as np
import torch

from recforge.train.loop.step_loop import WindowMetrics
from recforge.train.metrics import auc, logloss, normalized_entropy


def test_window_metrics_match_reference_and_ignore_padding():
    torch.manual_seed(0)
    window = WindowMetrics()
    all_labels, all_logits = [], []
    for _ in range(3):
        logits = torch.randn(8, 1)
        labels = (torch.rand(8) < 0.4).float()
        weights = torch.ones(8)
        weights[-3:] = 0.0  # padding rows must not count
        window.add(logits, labels, weights)
        all_labels.append(labels[:5].numpy())
        all_logits.append(logits.reshape(-1)[:5].numpy())
    got = window.gather(world_size=1, rank=0)
    y, s = np.concatenate(all_labels), np.concatenate(all_logits)
    assert got["train_auc"] == auc(y, s)
    assert got["train_logloss"] == logloss(y, s)
    assert got["train_ne"] == normalized_entropy(y, s)
    assert window.gather(world_size=1, rank=0) == {}  # the window was reset


def test_single_class_window_reports_nothing():
    window = WindowMetrics()
    window.add(torch.randn(4, 1), torch.zeros(4), torch.ones(4))
    assert window.gather(world_size=1, rank=0) == {}
