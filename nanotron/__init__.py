"""nanotron: minimal 3D-parallel (dp x tp x pp) Llama pretraining on DeviceMesh/DTensor."""

__version__ = "0.1.0"
