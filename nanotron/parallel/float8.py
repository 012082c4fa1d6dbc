"""Float8 training (`training.float8`) through torchao: the decoder layers' linears become torchao's Float8Linear
before the TP plan and FSDP are applied (torchao's order), so each matmul casts its operands to float8 with
tensorwise or rowwise dynamic scales and accumulates in the compute dtype. Master weights stay as they were:
checkpoints hold the same tensors under the same names, with or without float8.

Which linears convert is one rule, the same at every layout: a linear inside a decoder layer whose two weight
dimensions are multiples of 16 (what float8 matmul kernels take). The embedding and the output head are not
converted (they set the logits' precision), nor are the MoE routers and the experts' grouped GEMMs (not linears).
On a device without float8 matmuls (CPU, CUDA below compute capability 8.9) torchao emulates them: same numerics,
no speed; the start-up line says so. torchao is imported only by a float8 run (its import costs seconds).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from nanotron.config import Config
from nanotron.config.training import FLOAT8_KERNEL_MULTIPLE
from nanotron.errors import ConfigError
from nanotron.models.llama import LlamaForCausalLM
from nanotron.parallel.tensor import tp_shard_dim
from nanotron.parallel.torch_private import pytree_logger

FLOAT8_MATMUL_CAPABILITY = (8, 9)  # Ada / Hopper and newer


def emulation_reason(device: torch.device) -> str | None:
    """Why this device emulates float8 matmuls, or None where it has them."""
    if device.type != "cuda":
        return f"{device.type} has no float8 matmul"
    capability = torch.cuda.get_device_capability(device)
    if capability < FLOAT8_MATMUL_CAPABILITY:
        return f"CUDA compute capability {capability[0]}.{capability[1]} is below 8.9"
    return None


def torchao_float8():
    """torchao.float8, imported without the warnings its import logs on every rank (GPU kernel libraries a CPU build
    lacks, a torch deprecation of how it registers enums)."""
    loggers = [logging.getLogger("torchao"), pytree_logger()]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        import torchao.float8
        import torchao.float8.float8_tensor_parallel  # noqa: F401  (the TP plans, imported by tensor.py when used)
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
    return torchao.float8


def float8_config(recipe: str, emulate: bool, fsdp_float8_all_gather: bool):
    """torchao's config for `recipe`; FSDP all-gathers float8 weights where the recipe allows it (tensorwise)."""
    Float8LinearConfig = torchao_float8().Float8LinearConfig
    if recipe == "tensorwise":
        return Float8LinearConfig(emulate=emulate, enable_fsdp_float8_all_gather=fsdp_float8_all_gather)
    base = Float8LinearConfig.from_recipe_name(recipe)
    return Float8LinearConfig(
        cast_config_input=base.cast_config_input,
        cast_config_weight=base.cast_config_weight,
        cast_config_grad_output=base.cast_config_grad_output,
        round_scales_to_power_of_2=base.round_scales_to_power_of_2,
        emulate=emulate,
    )


def converts(fqn: str, module: nn.Module) -> bool:
    """The rule: a linear of a decoder layer whose weight dimensions float8 kernels take."""
    return (
        isinstance(module, nn.Linear)
        and fqn.startswith("model.layers.")
        and all(size % FLOAT8_KERNEL_MULTIPLE == 0 for size in module.weight.shape)
    )


@dataclass(frozen=True)
class Float8Plan:
    """Which linears of the whole model convert and which stay in the compute dtype (full FQNs)."""

    converted: tuple[str, ...]
    kept: tuple[str, ...]

    @classmethod
    def of(cls, model: nn.Module) -> Float8Plan:
        linears = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, nn.Linear)]
        return cls(tuple(f for f, m in linears if converts(f, m)), tuple(f for f, m in linears if not converts(f, m)))


def check_float8(cfg: Config, device: torch.device) -> None:
    """What float8 needs of the layout and the device, checked where both are known. Float8 matmul kernels need
    every converted linear's dimensions to be multiples of 16 on each rank: a TP shard that is not would make the
    layout change which linears convert (and the numbers), so it is a config error instead."""
    t, p = cfg.training, cfg.parallelism
    if t.compile and emulation_reason(device):
        raise ConfigError(
            f"training.float8='{t.float8}' runs emulated on this device ({emulation_reason(device)}), and torchao's "
            "emulation is eager-only; set training.compile=false (or train on a GPU with float8 matmuls)"
        )
    if p.tp == 1:
        return
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg.model)
    for fqn in Float8Plan.of(model).converted:
        module = model.get_submodule(fqn)
        dim = tp_shard_dim(fqn)  # a MoE layer's shared experts are not split over tp
        if dim is not None and (module.weight.shape[dim] // p.tp) % FLOAT8_KERNEL_MULTIPLE:
            raise ConfigError(
                f"training.float8='{t.float8}' with parallelism.tp={p.tp}: {fqn} would hold "
                f"{module.weight.shape[dim]}/{p.tp} = {module.weight.shape[dim] // p.tp} rows or columns per rank, "
                f"not a multiple of {FLOAT8_KERNEL_MULTIPLE}; use a smaller tp, or training.float8='off'"
            )


def convert_to_float8(model: nn.Module, cfg: Config, device: torch.device) -> None:
    """Swaps the rule's linears of `model` (a whole model or a pipeline stage) for Float8Linear, in place."""
    config = float8_config(cfg.training.float8, emulation_reason(device) is not None, fsdp_float8_all_gather(cfg))
    torchao_float8().convert_to_float8_training(
        model, module_filter_fn=lambda module, fqn: converts(fqn, module), config=config
    )


def fsdp_float8_all_gather(cfg: Config) -> bool:
    """FSDP2 gathers float8 weights (half of bf16's bytes) under tensorwise scaling when it shards (zero >= 1)."""
    return cfg.training.float8 == "tensorwise" and cfg.parallelism.zero_stage >= 1


def float8_tp_collectives(cfg: Config, device: torch.device) -> bool:
    """Whether the TP plan moves float8 tensors (torchao's float8 plans: tensorwise scales only). Not on gloo, which
    has no float8 collectives ("Invalid scalar type"): there the plain plans move the compute dtype, and each linear
    casts after the collective, with the same global amax (the DTensor reduces it), so the numbers are the same."""
    return cfg.training.float8 == "tensorwise" and device.type == "cuda"


def precompute_float8_scales(modules: list[nn.Module]) -> None:
    """After the weights change (optimizer step, checkpoint load): the float8 scales of all FSDP-sharded weights
    from their global amaxes in one all-reduce, instead of one per weight at each all-gather. A no-op where FSDP
    does not gather float8 weights."""
    for module in modules:
        torchao_float8().precompute_float8_dynamic_scale_for_fsdp(module)


@torch.no_grad()
def plain_tensors(state: dict[str, object]) -> dict[str, object]:
    """`state` with FSDP's float8 weights (torchao's wrapper subclass, in their DTensors) as the plain tensors they
    wrap, sharing storage: a checkpoint then holds ordinary tensors that any process loads (torch.load's
    weights_only refuses the subclass where torchao is not imported), and a load into them fills the weights."""
    fsdp_utils = sys.modules.get("torchao.float8.fsdp_utils")
    if fsdp_utils is None:  # no float8 weight exists in this process
        return state
    wrapper = fsdp_utils.WeightWithDynamicFloat8CastTensor

    def plain(value: object) -> object:
        local = value.to_local() if isinstance(value, DTensor) else value
        if not isinstance(local, wrapper):
            return value
        inner = local._tensor  # the wrapped master weight (the subclass's one inner tensor)
        if not isinstance(value, DTensor):
            return inner
        return DTensor.from_local(
            inner, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
        )

    return {key: plain(value) for key, value in state.items()}


def describe_float8(cfg: Config, device: torch.device) -> str:
    """The start-up line: recipe, emulated or not, and the rule's converted and kept linears."""
    with torch.device("meta"):
        plan = Float8Plan.of(LlamaForCausalLM(cfg.model))
    reason = emulation_reason(device)
    how = f"emulated ({reason}: same numerics, no speed-up)" if reason else "float8 matmuls"
    gather = ", FSDP all-gathers float8 weights" if fsdp_float8_all_gather(cfg) else ""
    return (
        f"float8: {cfg.training.float8} scaling, {how}{gather}; {len(plan.converted)} decoder-layer linears "
        f"converted ({_pattern(plan.converted)}); kept in {cfg.training.dtype}: {', '.join(_unique(plan.kept)) or '-'}"
        f", the embedding" + (", MoE routers and experts' grouped GEMMs" if cfg.model.moe.num_experts else "")
    )


def _unique(fqns: tuple[str, ...]) -> list[str]:
    """FQNs with the layer index replaced by '*', each once, in order."""
    seen: dict[str, None] = {}
    for fqn in fqns:
        parts = fqn.split(".")
        if fqn.startswith("model.layers."):
            parts[2] = "*"
        seen[".".join(parts)] = None
    return list(seen)


def _pattern(fqns: tuple[str, ...]) -> str:
    return ", ".join(_unique(fqns))
