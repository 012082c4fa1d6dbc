"""What the plan needs of training.float8: the linears nanotron.parallel.float8's rule converts (found on a meta
model of the config), the FLOPs that run at the float8 peak, and the bytes the casts to float8 move."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanotron.config import Config, ModelConfig
from nanotron.config.training import FLOAT8_KERNEL_MULTIPLE
from nanotron.models.llama import LlamaForCausalLM
from nanotron.models.shapes import element_bytes
from nanotron.parallel.float8 import Float8Plan, fsdp_float8_all_gather
from nanotron.parallel.tensor import tp_shard_dim


@dataclass(frozen=True)
class Float8Linears:
    """What the plan needs of the linears training.float8 converts (nanotron.parallel.float8's rule, applied to a
    meta model of the config): per decoder layer and last for the rest of the model (none under today's rule), their
    weight elements, their input features and their input plus output features (summed over the converted linears),
    and the weights of all linears there converted or not;
    the model's converted FQNs with their shapes, how many decoder-layer linears stay unconverted (a dimension
    float8 kernels can't take), and its parameter count."""

    weights: tuple[int, ...]
    inputs: tuple[int, ...]
    features: tuple[int, ...]
    linear_weights: tuple[int, ...]
    shapes: dict[str, tuple[int, ...]]
    kept: int
    params: int


_FLOAT8_LINEARS: dict[str, Float8Linears] = {}  # by the model config's repr: a --search plans one model many times


def float8_linears(m: ModelConfig) -> Float8Linears:
    key = repr(m)
    if key not in _FLOAT8_LINEARS:
        with torch.device("meta"):
            model = LlamaForCausalLM(m)
        converted = set(Float8Plan.of(model).converted)
        weights, inputs, features, linear_weights = ([0] * (m.num_layers + 1) for _ in range(4))
        kept = 0
        for fqn, module in model.named_modules():
            if not isinstance(module, torch.nn.Linear):
                continue
            in_layer = fqn.startswith("model.layers.")
            i = int(fqn.split(".")[2]) if in_layer else m.num_layers
            linear_weights[i] += module.weight.numel()
            kept += in_layer and fqn not in converted
            if fqn in converted:
                weights[i] += module.weight.numel()
                inputs[i] += module.in_features
                features[i] += module.in_features + module.out_features
        shapes = {fqn: tuple(model.get_submodule(fqn).weight.shape) for fqn in converted}
        params = sum(param.numel() for param in model.parameters())
        _FLOAT8_LINEARS[key] = Float8Linears(
            tuple(weights), tuple(inputs), tuple(features), tuple(linear_weights), shapes, kept, params
        )
    return _FLOAT8_LINEARS[key]


def float8_tp_fits(cfg: Config) -> bool:
    """Whether every converted linear keeps float8 kernels' multiple of 16 on each tp rank (the trainer refuses the
    layout otherwise: nanotron.parallel.float8.check_float8)."""
    tp = cfg.parallelism.tp
    for fqn, shape in float8_linears(cfg.model).shapes.items():
        dim = tp_shard_dim(fqn)
        if dim is not None and (shape[dim] // tp) % FLOAT8_KERNEL_MULTIPLE:
            return False
    return True


def float8_flops(cfg: Config, modes: list[str], rerun_matmuls: float) -> tuple[float, float]:
    """(float8 FLOPs of the step's model FLOPs, of its recompute): 6 per converted weight a token meets (forward and
    backward), 2 more for each layer whose forward is fully recomputed, and the converted share of what selective
    recompute's every_other policy reruns (`rerun_matmuls` per token and layer). 0 without float8."""
    if cfg.training.float8 == "off":
        return 0.0, 0.0
    lin = float8_linears(cfg.model)
    tokens_step = cfg.training.global_batch_size * cfg.training.seq_len
    recompute = 0.0
    for weights, linear_weights, mode in zip(lin.weights, lin.linear_weights, modes):
        if mode == "full":
            recompute += 2 * weights
        elif mode == "selective" and linear_weights:
            recompute += rerun_matmuls * weights / linear_weights
    return 6 * sum(lin.weights) * tokens_step, recompute * tokens_step


def float8_cast_bytes(cfg: Config, modes: list[str]) -> float:
    """Bytes per step that one rank's casts to float8 move through memory (memory-bound; what compile fuses is not
    discounted). Each element of a converted linear's input and of its output gradient is read for its amax, read
    again and written in float8, and written once more transposed for the weight gradient: 2 x 16-bit + 2 bytes,
    per token (a fully recomputed forward casts its inputs again), shared evenly over the ranks (rowwise under TP
    casts a gathered input on every tp rank: not counted); and each tp-local converted weight likewise once per
    microbatch, except under the FSDP float8 all-gather, where each rank casts its shard (its amax comes from the
    step's scale precompute) and the gathered float8 weight is only transposed for backward (1 byte read, 1
    written)."""
    if cfg.training.float8 == "off":
        return 0.0
    lin = float8_linears(cfg.model)
    t, p = cfg.training, cfg.parallelism
    per_element = 2 * element_bytes(t.dtype) + 2  # amax read, cast read, float8 written, transposed copy written
    tokens_step = t.global_batch_size * t.seq_len
    recast = sum(inputs for inputs, mode in zip(lin.inputs, modes) if mode == "full")
    activations = tokens_step / cfg.world_size * (sum(lin.features) + recast) * per_element
    e = element_bytes(t.dtype)
    per_weight = 2 + (e + 1) / cfg.fsdp_shard_size if fsdp_float8_all_gather(cfg) else per_element
    weights = t.grad_accum_steps * sum(lin.weights) / (p.tp * p.pp) * per_weight
    return activations + weights
