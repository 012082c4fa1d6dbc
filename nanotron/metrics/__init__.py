"""Metrics: the logging rank's sinks (`logger`, `wandb_run`), what a step measures (`step`), activation statistics
(`activations`), profiler traces (`profiler`), and a run's figures and summary from its metrics.jsonl (`report`)."""
