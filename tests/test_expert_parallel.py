"""Mixture of experts and expert parallelism: the dispatcher against the one-rank path over real gloo groups
(uneven splits, an expert and a whole rank without tokens), and the layout matrix: every ep layout held to one
process (losses, gradient norms, activation statistics, final weights and the routers' balancing bias)."""

from __future__ import annotations

import os
import re
import socket

import pytest
import torch
import torch.distributed as dist
from conftest import TINY_MODEL, run_train, train_losses
from matrix import EXPERTS, MOE, Layout, assert_matches, weights

from nanotron.models.moe import GroupedExperts, LocalDispatch
from nanotron.parallel.expert import AllToAllDispatch

E, H, INTER = 8, 12, 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Rank 0 sends rows to experts 0, 2, 3, 5 and 7 (nothing to 1, 4, 6); rank 1 sends nothing at all. In the
# second case only rank 1's experts (4-7) get rows: rank 0's experts receive none and must still take part in
# backward's all-to-alls (a rank whose experts run on no rows once left them out: a collective mismatch).
ROUTES = ([3, 0, 2, 1, 0, 4, 0, 1], [0, 0, 0, 0, 0, 4, 0, 1])


def routed_tokens(rank: int, case: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.tensor(ROUTES[case]) if rank == 0 else torch.zeros(E, dtype=torch.long)
    x = torch.randn(int(counts.sum()), H, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    return x, counts


def experts_module() -> GroupedExperts:
    experts = GroupedExperts(E, H, INTER).double()
    g = torch.Generator().manual_seed(7)
    for p in experts.parameters():
        p.data = torch.randn(p.shape, dtype=torch.float64, generator=g)
    return experts


def _dispatch_worker(rank: int, port: int, queue, case: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    full = experts_module()
    local = GroupedExperts(E // 2, H, INTER).double()  # this rank's experts: 4 x rank ... 4 x rank + 3
    local.gate_up_proj.data = full.gate_up_proj.data[4 * rank : 4 * rank + 4].clone()
    local.down_proj.data = full.down_proj.data[4 * rank : 4 * rank + 4].clone()
    results = []
    for overlap in (False, True):  # the shared work's result is the caller's to add either way
        x, counts = routed_tokens(rank, case)
        x.requires_grad_()
        out, done = AllToAllDispatch(dist.group.WORLD, ep=2, overlap=overlap)(x, counts, local, x.sum)
        assert (done is not None) == overlap
        outputs = [out] if done is None else [out, done]  # x.sum's gradient: 1 more in every x.grad
        torch.autograd.backward(outputs, [torch.ones_like(out) * 0.5, torch.ones(())][: len(outputs)])
        grads = [p.grad.numpy() for p in (local.gate_up_proj, local.down_proj)]
        local.zero_grad()
        results.append((out.detach().numpy(), x.grad.numpy(), grads))
    queue.put((rank, results))
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("case", [0, 1], ids=["rank-sends-nothing", "experts-receive-nothing"])
def test_all_to_all_dispatch_equals_local_experts_with_empty_experts_and_ranks(case, forkserver):
    queue, port = forkserver.Queue(), _free_port()
    procs = [forkserver.Process(target=_dispatch_worker, args=(r, port, queue, case)) for r in range(2)]
    for p in procs:
        p.start()
    by_rank = dict(queue.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    full = experts_module()
    x, counts = routed_tokens(0, case)
    x.requires_grad_()
    expected, _ = LocalDispatch()(x, counts, full, None)
    expected.backward(torch.ones_like(expected) * 0.5)
    for overlap in (0, 1):  # the dispatch all-to-all waited at once, or after the shared work
        results = {r: by_rank[r][overlap] for r in range(2)}
        out, dx, grads = results[0]
        assert torch.allclose(torch.from_numpy(out), expected.detach(), rtol=1e-12, atol=1e-12)
        assert torch.allclose(torch.from_numpy(dx), x.grad + 1 if overlap else x.grad, rtol=1e-12, atol=1e-12)
        assert results[1][0].shape == (0, H)  # the rank that sent nothing gets nothing back
        for name, index in (("gate_up_proj", 0), ("down_proj", 1)):  # divided by ep, before FSDP averages over edp
            want = getattr(full, name).grad / 2
            got = torch.cat([torch.from_numpy(results[r][2][index]) for r in range(2)])
            assert torch.allclose(got, want, rtol=1e-12, atol=1e-12), name


# ---- the layout matrix ----------------------------------------------------------------------------------------

EP_LAYOUTS = [
    Layout(dp=2, ep=2),
    Layout(dp=2, tp=2, ep=2, flags=("--parallelism.tp_mode=reduce_scatter", "--parallelism.recompute=selective")),
    Layout(dp=2, pp=2, ep=2, flags=("--parallelism.pp_engine=zero_bubble", "--training.micro_batch_size=1")),
    Layout(dp=4, ep=4, flags=("--parallelism.zero_stage=3",)),
    Layout(  # HSDP: experts split within each dp_shard group of 2, replicated across the 2 groups
        dp=4,
        pp=2,
        ep=2,
        flags=(
            "--parallelism.zero_stage=2",
            "--parallelism.dp_shard=2",
            "--parallelism.pp_engine=interleaved_1f1b",
            "--training.micro_batch_size=1",
        ),
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("layout", EP_LAYOUTS, ids=str)
def test_ep_layout_matches_one_process(layout, references, tiny_data, tmp_path):
    ref = references[EXPERTS]
    run = EXPERTS.run(tiny_data, tmp_path, "run", layout)
    assert len(ref.moe) == EXPERTS.steps and sorted(ref.stats) == [2, 4]
    assert any(name.endswith("expert_bias") for name in ref.weights)  # the balancing bias is compared
    print(f"{layout}: {assert_matches(run, ref, EXPERTS)}")


@pytest.mark.slow
def test_ep2_checkpoint_resumes_at_ep1_dp2_like_an_uninterrupted_run(tiny_data, tmp_path):
    """Saved at ep2 (experts split over two ranks), resumed at ep1 x dp2 (every rank holds every expert): the
    expert weights, their optimizer state and the routing biases reshard, and steps 3-4 are the same."""
    common = [*TINY_MODEL, *MOE, *tiny_data.overrides(), f"--job.out_dir={tmp_path}", "--parallelism.dp=2"]
    common += ["--checkpoint.save_final=true", "--optimizer.decay_steps=4", "--training.steps=4"]
    run_train([*common, "--job.name=reference", "--checkpoint.interval=2", "--parallelism.ep=2"], nproc=2)
    resume = f"--checkpoint.resume_from={tmp_path / 'reference' / 'checkpoints' / 'step-2'}"
    run_train([*common, "--job.name=second", resume], nproc=2)
    reference, resumed = train_losses(tmp_path / "reference"), train_losses(tmp_path / "second")
    assert len(reference) == 4 and len(resumed) == 2
    assert resumed == pytest.approx(reference[2:], rel=1e-7, abs=0)
    ref, second = weights(tmp_path / "reference", step=4), weights(tmp_path / "second", step=4)
    for name, bias in ref.items():
        if name.endswith("expert_bias"):
            assert bias.abs().sum() > 0 and torch.equal(second[name], bias), name


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({"parallelism.ep": "2"}, "parallelism.ep=2 needs a mixture-of-experts model"),
        (
            {"model.moe.num_experts": "6", "parallelism.dp": "4", "parallelism.ep": "4"},
            "model.moe.num_experts=6 is not divisible by parallelism.ep=4",
        ),
        (
            {"model.moe.num_experts": "8", "parallelism.dp": "2", "parallelism.ep": "4"},
            "parallelism.ep=4 must divide dp x cp = 2 x 1 = 2",
        ),
        (
            {"model.moe.num_experts": "8", "parallelism.dp": "4", "parallelism.dp_shard": "2", "parallelism.ep": "4"}
            | {"parallelism.zero_stage": "1"},
            "parallelism.ep=4 must divide dp_shard x cp = 2 x 1 = 2 under HSDP",
        ),
        ({"model.moe.num_experts": "4", "model.moe.top_k": "5"}, "model.moe.top_k=5 exceeds model.moe.num_experts=4"),
        ({"model.moe.num_experts": "4", "model.moe.router": "softmax"}, "model.moe.router: expected one of"),
        (
            {"model.moe.num_experts": "4", "model.moe.first_dense_layers": "4"},
            "model.moe.first_dense_layers=4 leaves no MoE layer",
        ),
        (
            {"model.moe.num_experts": "4", "model.moe.aux_loss_coef": "0.01", "parallelism.cp": "2"},
            "model.moe.aux_loss_coef > 0 with parallelism.cp > 1 is not supported",
        ),
        ({"model.moe.experts": "4"}, "unknown key 'model.moe.experts'"),
    ],
)
def test_bad_moe_configs_name_the_key(overrides, expected):
    from nanotron.config import load_config
    from nanotron.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(expected)):
        load_config("configs/tiny.toml", list(overrides.items()))


def naive_moe(moe, x: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert: sum over the chosen experts of gate x SwiGLU expert, plus the shared MLP."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        logits = flat[t] @ moe.gate.weight.T
        scores = logits.sigmoid() if moe.gate.sigmoid else logits.softmax(-1)
        chosen = (scores + moe.gate.expert_bias).topk(moe.top_k).indices
        gates = scores[chosen] / (scores[chosen].sum() if moe.gate.renormalize else 1)
        for g, e in zip(gates, chosen):
            gate, up = (moe.experts.gate_up_proj[e] @ flat[t]).chunk(2)
            out[t] += g * (moe.experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
        if moe.shared_experts is not None:
            out[t] += moe.shared_experts(flat[t])
    return out.view_as(x)


@pytest.mark.parametrize("router", ["softmax_topk", "sigmoid"])
def test_moe_layer_equals_a_token_by_token_loop(router):
    """The sorted, grouped computation against the definition (catches gates applied twice or not at all)."""
    from nanotron.config import ModelConfig
    from nanotron.config.validate import resolve_model
    from nanotron.models.llama import MLP
    from nanotron.models.moe import MoE

    cfg = ModelConfig(hidden_size=12, intermediate_size=16, num_layers=2, num_heads=2, num_kv_heads=1, vocab_size=8)
    cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.router, cfg.moe.num_shared_experts = 6, 2, router, 1
    resolve_model(cfg)
    moe = MoE(cfg, MLP(12, 16)).double()
    g = torch.Generator().manual_seed(3)
    for p in moe.parameters():
        p.data = torch.randn(p.shape, dtype=torch.float64, generator=g) * 0.5
    moe.gate.expert_bias = torch.tensor([0.3, 0.0, -0.2, 0.1, 0.0, 0.0], dtype=torch.float64)
    x = torch.randn(2, 5, 12, dtype=torch.float64, generator=g)
    assert torch.allclose(moe(x), naive_moe(moe, x), rtol=1e-12, atol=1e-12)
    assert int(moe.tokens_per_expert.sum()) == 2 * 5 * 2


def test_capacity_drops_per_sequence_so_batching_does_not_change_the_output():
    """capacity_factor keeps the earliest ceil(f x seq x top_k / E) (token, choice) pairs of each sequence per
    expert: a sequence gives the same output and the same dropped count alone or in any batch (any layout)."""
    from nanotron.config import ModelConfig
    from nanotron.config.validate import resolve_model
    from nanotron.models.moe import MoE

    cfg = ModelConfig(hidden_size=12, intermediate_size=16, num_layers=2, num_heads=2, num_kv_heads=1, vocab_size=8)
    cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.capacity_factor = 4, 2, 0.5
    resolve_model(cfg)
    moe = MoE(cfg).double()
    g = torch.Generator().manual_seed(5)
    for p in moe.parameters():
        p.data = torch.randn(p.shape, dtype=torch.float64, generator=g)
    x = torch.randn(3, 8, 12, dtype=torch.float64, generator=g)
    together = moe(x)
    dropped_together = int(moe.dropped_tokens)
    alone, dropped_alone = [], 0
    for b in range(3):
        moe.dropped_tokens.zero_()
        alone.append(moe(x[b : b + 1]))
        dropped_alone += int(moe.dropped_tokens)
    assert torch.allclose(together, torch.cat(alone), rtol=1e-12, atol=1e-12)
    assert dropped_together == dropped_alone > 0  # capacity 2 per expert per sequence: 16 pairs can't all fit
    assert int(moe.tokens_per_expert.sum()) + 2 * dropped_together == 2 * (3 * 8 * 2)  # kept + dropped, two passes


# ---- the experts' grouped GEMM (CUDA's kernel; it also runs on CPU in bf16) -------------------------------


@pytest.mark.parametrize(
    "device, dtype, hidden, intermediate, expected",
    [
        ("cuda", torch.bfloat16, 2048, 1408, "grouped"),
        ("cuda", torch.float32, 2048, 1408, "loop"),  # the kernel takes bf16 only
        ("cuda", torch.bfloat16, 2048, 1410, "loop"),  # 16-byte aligned widths only
        ("cuda", torch.bfloat16, 12, 16, "loop"),
        ("cpu", torch.bfloat16, 2048, 1408, "loop"),  # runs on CPU, but training there keeps the loop
    ],
)
def test_expert_kernel_is_chosen_by_device_dtype_and_alignment(device, dtype, hidden, intermediate, expected):
    from nanotron.parallel.expert import choose_expert_kernel

    assert choose_expert_kernel(device, dtype, hidden, intermediate) == expected


@pytest.mark.parametrize(
    "counts",
    [
        [13, 0, 8, 1, 30, 0, 7, 9],  # an empty expert, a group already aligned, a group of one
        [0, 0, 0, 0, 0, 0, 0, 0],  # no rows at all: the weights still get their (zero) gradients
        [0, 0, 0, 0, 0, 0, 0, 17],  # every row to the last expert, which also takes the buffer's slack
    ],
)
def test_padded_grouped_gemm_equals_the_per_expert_loop_in_bf16(counts):
    """Forward and backward of the SwiGLU experts through torch's grouped GEMM over groups padded to 8 rows,
    against the per-expert loop, in bf16 on CPU: the padding rows (zeros) must reach no output or gradient."""
    from nanotron.models.moe import expert_mlp
    from nanotron.parallel.expert import padded_grouped_mlp

    g = torch.Generator().manual_seed(0)
    counts = torch.tensor(counts)
    x = torch.randn(int(counts.sum()), 16, generator=g).bfloat16().requires_grad_()
    gate_up, down = ((torch.randn(E, *s, generator=g) * 0.3).bfloat16().requires_grad_() for s in ((48, 16), (16, 24)))
    dout = torch.randn(x.shape, generator=g).bfloat16()
    results = []
    for mlp in (expert_mlp, padded_grouped_mlp):
        out = mlp(x, counts, gate_up, down)
        results.append([out, *torch.autograd.grad(out, [x, gate_up, down], dout)])
    for name, got, want in zip(("out", "dx", "d gate_up", "d down"), *reversed(results)):
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2, msg=name)  # bf16 rounding


# ---- the host syncs of a MoE layer, and the shared experts under the token all-to-all --------------------------

# Ops that make the host wait for a CUDA device (the value read back, or an output size computed from values), seen
# on CPU by a dispatch mode; `tolist` dispatches no op and is counted by wrapping it.
SYNCING_OPS = ("aten._local_scalar_dense", "aten.bincount", "aten.nonzero", "aten.masked_select", "aten._unique2")


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def moe_layer(shared: bool = True, capacity_factor: float = 0.0, dtype=torch.float64):
    from nanotron.config import ModelConfig
    from nanotron.config.validate import resolve_model
    from nanotron.models.llama import MLP
    from nanotron.models.moe import MoE

    cfg = ModelConfig(hidden_size=16, intermediate_size=16, num_layers=2, num_heads=2, num_kv_heads=1, vocab_size=8)
    cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.router = E, 2, "sigmoid"
    cfg.moe.moe_intermediate_size, cfg.moe.num_shared_experts, cfg.moe.capacity_factor = 8, int(shared), capacity_factor
    resolve_model(cfg)
    moe = MoE(cfg, MLP(16, 16) if shared else None).to(dtype)
    g = torch.Generator().manual_seed(11)
    for p in moe.parameters():
        p.data = (torch.randn(p.shape, generator=g) * 0.5).to(dtype)
    return moe


def host_syncs(moe, x: torch.Tensor, monkeypatch) -> list[str]:
    """The calls that would stop a CUDA run's host in one forward and backward of `moe`."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen, last = [], [""]

    class Syncs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket)
            if name == "aten._local_scalar_dense" and last[0] in ("aten.aminmax", "aten.min", "aten.max"):
                return func(*args, **(kwargs or {}))  # one_hot's check of its ids' range, CPU only (2.11: min, max)
            if name in SYNCING_OPS or (name == "aten.repeat_interleave" and "output_size" not in (kwargs or {})):
                seen.append(name)
            last[0] = name
            return func(*args, **(kwargs or {}))

    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: seen.append("tolist") or tolist(t))
    with Syncs():
        moe(x).square().sum().backward()
    monkeypatch.undo()
    return seen


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_a_moe_layer_syncs_the_host_once_with_expert_parallelism_and_never_without(overlap, world_of_one, monkeypatch):
    """Issue 44: the grouped GEMM path (CUDA's) reads nothing back without expert parallelism; with it, the one read
    is the all-to-all's split sizes (host integers for all_to_all_single: dropless routing has no fixed sizes);
    capacity_factor adds the kept count. Counted over one forward and backward, bf16 (the grouped GEMM's dtype)."""
    from nanotron.parallel.expert import padded_grouped_mlp

    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1)).bfloat16().requires_grad_()
    cases = [(0.0, False, []), (0.0, True, ["tolist"]), (1.0, True, ["aten._local_scalar_dense", "tolist"])]
    for capacity, ep, expected in cases:
        moe = moe_layer(capacity_factor=capacity, dtype=torch.bfloat16)
        moe.experts.mlp = padded_grouped_mlp
        if ep:
            moe.dispatcher = AllToAllDispatch(dist.group.WORLD, ep=1, overlap=overlap)
        assert host_syncs(moe, x, monkeypatch) == expected, (capacity, ep)


def test_the_shared_experts_run_while_the_tokens_travel_forward_and_backward(world_of_one, monkeypatch):
    """parallelism.ep_overlap: the token all-to-all starts, the shared experts run, then it is waited for; in
    backward the tokens' gradients start home before the shared experts' backward and are waited for after it. Seen
    through the order of events (not timing), on a one-rank group; the layer's output and gradients are those of
    the local experts either way (float64)."""
    from nanotron.parallel import expert

    events = []
    start, wait = expert._InFlight.start, expert._InFlight.wait
    monkeypatch.setattr(expert._InFlight, "start", lambda self, *a, **k: events.append("start") or start(self, *a, **k))
    monkeypatch.setattr(expert._InFlight, "wait", lambda self: events.append("wait") or wait(self))
    x = torch.randn(2, 8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    results = {}
    for name, overlap in (("local", None), ("overlap", True), ("no overlap", False)):
        moe = moe_layer()
        if overlap is not None:
            moe.dispatcher = AllToAllDispatch(dist.group.WORLD, ep=1, overlap=overlap)
        shared = moe.shared_experts
        shared.register_forward_pre_hook(lambda *_: events.append("shared forward"))
        shared.register_full_backward_pre_hook(lambda *_: events.append("shared backward"))
        shared.register_full_backward_hook(lambda *_: events.append("shared backward done"))
        events.clear()
        xi = x.clone().requires_grad_()
        out = moe(xi)
        forward = list(events)
        out.square().sum().backward()
        results[name] = (out.detach(), xi.grad, [p.grad for p in moe.parameters()], forward, events[len(forward) :])
    *_, forward, backward = results["overlap"]
    assert forward == ["start", "shared forward", "wait"]
    assert backward == ["start", "shared backward", "shared backward done", "wait"]
    assert results["no overlap"][3:] == (["shared forward"], ["shared backward", "shared backward done"])
    for name in ("overlap", "no overlap"):
        out, dx, grads = results[name][:3]
        torch.testing.assert_close(out, results["local"][0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(dx, results["local"][1], rtol=1e-12, atol=1e-12)
        for got, want in zip(grads, results["local"][2]):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
