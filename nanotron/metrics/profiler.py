"""torch.profiler traces of a few steps (`[profiler]`), or a no-op when profiling is off."""

from __future__ import annotations

import torch

from nanotron.config import ProfilerConfig


class Profiler:
    """torch.profiler traces (TensorBoard/Chrome JSON) of a few steps, or a no-op when profiling is off."""

    def __init__(self, profile: torch.profiler.profile | None):
        self.profile = profile

    @classmethod
    def start(cls, cfg: ProfilerConfig, device: torch.device, worker: str, enabled: bool) -> Profiler:
        """Profiles on rank 0 and the logging rank (`enabled`), when profiler.export_path is set."""
        if not cfg.export_path or not enabled:
            return cls(None)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profile = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=cfg.wait_steps, warmup=1, active=cfg.active_steps, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(cfg.export_path, worker_name=worker),
            record_shapes=True,
            profile_memory=True,
        )
        profile.start()
        return cls(profile)

    def step(self) -> None:
        if self.profile is not None:
            self.profile.step()

    def stop(self) -> None:
        if self.profile is not None:
            self.profile.stop()
