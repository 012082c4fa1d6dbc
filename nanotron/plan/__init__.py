"""`nanotron plan`: per-rank memory and step-time estimates, layout search, fake-process-group build check."""
