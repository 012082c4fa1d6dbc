"""Per-rank memory and step-time estimates, layout search, fake-process-group build check (`nanotron plan`)."""
