"""Parallelism applied from outside the plain model: `mesh` (the process group, the DeviceMesh, where this rank
sits on it), `parallelize` (the split, TP/SP, recompute, compile and FSDP plan, then init), `runner` (running a
step's microbatches at any layout), and one module per dimension: `tensor`, `pipeline`, `fsdp`, `recompute`,
`init`. Private torch APIs are reached only through `torch_private`."""
