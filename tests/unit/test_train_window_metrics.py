"""Windowed training quality (AUC / logloss / NE) equals the metrics computed on the window's real rows."""
import numpy as np
import torch

from recforge.train.loop.window_metrics import WindowMetrics
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


def test_the_reporter_adds_the_quality_off_the_calling_thread_in_window_order():
    import threading

    from recforge.train.loop.window_metrics import WindowReporter, window_quality

    rng = np.random.default_rng(0)
    got: list[tuple[int, dict, str]] = []
    reporter = WindowReporter(lambda m, step: got.append((step, m, threading.current_thread().name)))
    windows = []
    for step in (20, 40, 60):
        y = (rng.random(500) < 0.3).astype(np.float32)
        s = rng.standard_normal(500).astype(np.float32)
        windows.append((y, s))
        reporter.report({"train_loss": 0.5, "samples_per_s": 100.0}, step, (y, s))
    reporter.report({"train_loss": 0.4, "samples_per_s": 90.0}, 61, None)  # no rows: the loss alone
    reporter.close()
    assert [g[0] for g in got] == [20, 40, 60, 61]
    assert all(name.startswith("window-metrics") for _, _, name in got)
    for (_, m, _), (y, s) in zip(got, windows, strict=False):
        assert m == {"train_loss": 0.5, "samples_per_s": 100.0, **window_quality(y, s)}
        assert m["train_auc"] == auc(y, s) and m["train_ne"] == normalized_entropy(y, s)
    assert got[3][1] == {"train_loss": 0.4, "samples_per_s": 90.0}


def test_a_failing_sink_or_quality_loses_only_that_window_and_one_class_windows_carry_no_quality(monkeypatch):
    from recforge.train.loop import window_metrics
    from recforge.train.loop.window_metrics import WindowReporter

    calls: list[int] = []

    def flaky(m, step):
        calls.append(step)
        if step == 20:
            raise RuntimeError("tracking store down")

    reporter = WindowReporter(flaky)
    for step in (20, 40):
        reporter.report({"train_loss": 0.5}, step, (np.zeros(8, np.float32), np.zeros(8, np.float32)))
    reporter.close()  # logged, not raised; the next window still went out
    assert calls == [20, 40]
    got: list[dict] = []
    reporter = WindowReporter(lambda m, step: got.append(m))
    reporter.report({"train_loss": 0.5}, 20, (np.ones(8, np.float32), np.zeros(8, np.float32)))  # one class
    monkeypatch.setattr(window_metrics, "auc", lambda y, s: 1 / 0)  # the quality fails: the loss still goes out
    reporter.report({"train_loss": 0.4}, 40, (np.array([0.0, 1.0]), np.array([0.1, 0.2])))
    reporter.close()
    assert got == [{"train_loss": 0.5}, {"train_loss": 0.4}]
