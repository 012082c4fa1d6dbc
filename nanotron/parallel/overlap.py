"""What lets a layout's communication overlap its compute on CUDA: async TP (inductor's micro-pipelined sequence
parallelism) and the number of hardware queues (CUDA_DEVICE_MAX_CONNECTIONS) its collectives may use."""

from __future__ import annotations

from nanotron.config import Config


def async_tp_unavailable(cfg: Config, device_type: str) -> str | None:
    """Why parallelism.tp_linear_async_communication can't take effect here (None: it can).

    Async TP is inductor's micro-pipelining of sequence parallelism: it splits each all-gather before a
    column-parallel matmul and each reduce-scatter after a row-parallel one into chunks that overlap the
    matmul. Plain Megatron TP (all_reduce) has neither pattern, so there it would overlap nothing.
    """
    p = cfg.parallelism
    if p.tp == 1:
        return "async TP needs tp > 1"
    if p.tp_mode == "all_reduce":
        return (
            "with tp_mode='all_reduce' async TP has nothing to overlap (it overlaps the all-gathers and "
            "reduce-scatters of tp_mode='reduce_scatter' with the matmuls); use tp_mode='reduce_scatter'"
        )
    if not cfg.training.compile:
        return "async TP is an inductor pass: it needs training.compile=true"
    if device_type != "cuda":
        return "async TP needs CUDA (symmetric memory)"
    return None


def max_connections(cfg: Config) -> str | None:
    """CUDA_DEVICE_MAX_CONNECTIONS for this layout (None: CUDA's default).

    1 (one hardware queue: kernels start in launch order) is Megatron's trick so TP collectives start
    before the compute queued after them; it helps only where TP is the only traffic. With data-parallel
    (FSDP2 all-gathers, reduce-scatters), context-parallel (the ring's send/recv; FSDP over dp x cp), pipeline
    (send/recv) or async-TP streams it serialises their communication with compute, so those layouts get 32, the
    number of streams FSDP2's authors advise.
    """
    p = cfg.parallelism
    if cfg.world_size == 1:
        return None
    async_tp = p.tp_linear_async_communication and async_tp_unavailable(cfg, "cuda") is None
    if p.tp > 1 and p.dp == 1 and p.cp == 1 and p.pp == 1 and not async_tp:
        return "1"
    return "32"
