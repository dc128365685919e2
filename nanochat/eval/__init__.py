"""Measurement: bits per byte per supervision step (loss_eval), accuracy by hop count (hops_eval), the training log
and reports (metrics) and the training warnings (health)."""
