"""The synchronous step loop and what feeds it: a rank's batches from leased tasks, the loss normalization of
padded distributed steps, gradient accumulation, logging-window hooks and the per-sample ledger."""
