"""Canaries: every private torch API behind the two doors, exercised on the installed torch in one process.

A torch upgrade that moves, renames or changes one of them fails the test named after it here, in seconds,
instead of a run on a cluster. Each test checks the effect the project relies on, not only that a name exists.
"""

from __future__ import annotations

import pickle
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import nanotron.checkpoint.torch_private as checkpoint_door
import nanotron.parallel.torch_private as door
from nanotron.checkpoint.safe_io import _MetadataUnpickler


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_set_group_timeout_changes_an_existing_groups_timeout(world_of_one):
    door.set_group_timeout(dist.group.WORLD, timedelta(seconds=123))
    assert dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout == timedelta(seconds=123)


def test_flatten_mesh_names_a_new_dimension_of_the_root_mesh_that_submesh_finds_without_slicing_it(world_of_one):
    mesh = init_device_mesh("cpu", (1, 1, 1, 1), mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp"))
    flat = door.flatten_mesh(mesh, ("dp_replicate", "dp_shard"), "dp")
    shard_cp = door.flatten_mesh(mesh, ("dp_shard", "cp"), "dp_shard_cp")
    assert flat.mesh_dim_names == ("dp",) and flat.size() == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when a flattened dim is sliced from the root mesh
        assert door.submesh(mesh, "dp") is flat and door.submesh(mesh, "pp").mesh_dim_names == ("pp",)
        hsdp = door.submesh(mesh, "dp_replicate", "dp_shard_cp")
        assert hsdp.mesh_dim_names == ("dp_replicate", "dp_shard_cp") and hsdp.size() == 1
        assert door.submesh(mesh, "dp_shard", "cp").mesh_dim_names == ("dp_shard", "cp")
    assert shard_cp.size() == 1


def test_replicate_keeps_names_and_averages_gradients(world_of_one):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    names = [name for name, _ in model.named_parameters()]
    door.replicate(model, init_device_mesh("cpu", (1,)), torch.distributed.fsdp.MixedPrecisionPolicy())
    model(torch.ones(3, 4)).sum().backward()
    assert [name for name, _ in model.named_parameters()] == names
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("selective", [False, True])
def test_checkpoint_in_place_keeps_names_and_recomputes_in_backward(selective):
    from nanotron.parallel.recompute import selective_contexts

    layer, forwards = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)), []
    layer[0].register_forward_hook(lambda module, args, out: forwards.append(door.in_backward_pass()))
    assert not door.is_checkpointed(layer)
    door.checkpoint_in_place(layer, selective_contexts("all") if selective else None)
    assert door.is_checkpointed(layer)
    assert [name for name, _ in layer.named_parameters()] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    layer(torch.ones(2, 4)).sum().backward()
    assert forwards == [False, True]  # the forward, then its recomputation inside backward


@pytest.mark.parametrize("selective", [False, True])
def test_a_copy_of_a_checkpointed_layer_runs_its_own_forward(selective):
    """A deep copy of a checkpointed layer (what a pipeline split or an EMA copy makes) recomputes with its own
    weights: a forward kept as a closure over the original module would run the original's."""
    import copy

    from nanotron.parallel.recompute import selective_contexts

    layer = nn.Linear(4, 4)
    door.checkpoint_in_place(layer, selective_contexts("all") if selective else None)
    twin = copy.deepcopy(layer)
    with torch.no_grad():
        twin.weight.zero_()
        twin.bias.fill_(1.0)
    assert door.is_checkpointed(twin)
    out = twin(torch.ones(2, 4))
    torch.testing.assert_close(out, torch.ones(2, 4))
    out.sum().backward()
    assert layer.weight.grad is None and twin.weight.grad is not None


def test_a_compiled_selective_layer_keeps_what_the_policy_keeps():
    """torch.compile applies selective recompute's policy inside the compiled layer: the layer keeps for backward
    fewer activations than without recompute (its matmul outputs, not the SiLUs' inputs), fewer still when only
    every other matmul is kept, and more than full recompute (its input only). Under torch's composable
    checkpoint hooks the policy never saw a compiled layer's ops, and selective kept what full keeps."""
    from nanotron.parallel.recompute import selective_contexts

    def saved_elements(mode: str) -> int:
        torch.manual_seed(0)
        layer = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(16, 16), nn.SiLU())])
        if mode != "none":
            door.checkpoint_in_place(layer, None if mode == "full" else selective_contexts(mode))
        layer.compile()
        sizes: list[int] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            out = layer(torch.randn(4, 8, 16, requires_grad=True))
        out.sum().backward()
        return sum(sizes)

    saved = {mode: saved_elements(mode) for mode in ("none", "all", "every_other", "full")}
    assert saved["none"] > saved["all"] > saved["every_other"] > saved["full"], saved


def test_async_collective_tensor_is_what_functional_collectives_return(world_of_one):
    import torch.distributed._functional_collectives as funcol

    out = funcol.all_reduce(torch.ones(2), "sum", dist.group.WORLD)
    assert isinstance(out, door.AsyncCollectiveTensor)
    out.wait()


def test_stage_backward_returns_input_gradients():
    x = torch.ones(3, requires_grad=True)
    y = x * 2
    grads = door.stage_backward([y], [torch.ones(3)], [x])
    assert torch.equal(grads[0], torch.full((3,), 2.0))


def test_reduce_accumulated_gradients_reduce_scatters_held_gradients(world_of_one):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    for layer in model:
        fully_shard(layer, mesh=init_device_mesh("cpu", (1,)))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    model.set_requires_gradient_sync(False)  # accumulate unsharded, as a split backward's weight pass leaves it
    model(torch.ones(2, 4)).sum().backward()
    assert all(p.grad is None for p in model.parameters())
    door.reduce_accumulated_gradients(model, reshard=True)
    assert all(p.grad is not None for p in model.parameters())


def test_enable_inductor_async_tp_sets_inductors_flag():
    from torch._inductor import config as inductor_config

    before = inductor_config._micro_pipeline_tp
    try:
        door.enable_inductor_async_tp()
        assert inductor_config._micro_pipeline_tp is True
    finally:
        inductor_config._micro_pipeline_tp = before


def test_fake_process_group_plays_any_rank():
    door.fake_process_group(rank=5, world_size=512)
    try:
        assert (dist.get_rank(), dist.get_world_size()) == (5, 512)
        dist.all_reduce(torch.ones(1))  # moves nothing, returns at once
    finally:
        dist.destroy_process_group()


def test_dcp_index_private_globals_exist_and_are_all_a_saved_index_needs(tmp_path):
    for qualified in checkpoint_door.DCP_INDEX_PRIVATE_GLOBALS:
        module, _, name = qualified.rpartition(".")
        assert hasattr(__import__(module, fromlist=[name]), name), qualified
    dcp.save({"w": torch.ones(2, 3), "lr": 0.5}, checkpoint_id=tmp_path, no_dist=True)
    with open(tmp_path / ".metadata", "rb") as f:
        metadata = _MetadataUnpickler(f).load()  # refuses any global outside the allow-list
    assert list(metadata.state_dict_metadata["w"].size) == [2, 3]
    with open(tmp_path / ".metadata", "rb") as f:
        assert pickle.load(f).state_dict_metadata.keys() == metadata.state_dict_metadata.keys()


def test_set_element_writes_into_a_nested_state_dict():
    state: dict = {"optimizer": {"param_groups": [{"lr": 0.0}]}}
    checkpoint_door.set_element(state, ("optimizer", "param_groups", 0, "lr"), 0.25)
    assert state["optimizer"]["param_groups"][0]["lr"] == 0.25


def test_attention_with_lse_returns_the_rows_log_sum_exp_and_its_backward_the_gradients():
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, 3, 6, 8, dtype=torch.float64, generator=g) for _ in range(4))
    mask = torch.zeros(2, 1, 6, 6, dtype=torch.float64)
    mask[0, 0, 2, 4:] = float("-inf")
    out, lse = door.attention_with_lse(q, k, v, False, mask, 0.4)
    scores = q @ k.transpose(-1, -2) * 0.4 + mask
    assert torch.allclose(lse, scores.logsumexp(-1)) and torch.allclose(out, scores.softmax(-1) @ v)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ((leaves[0] @ leaves[1].transpose(-1, -2) * 0.4 + mask).softmax(-1) @ leaves[2]).backward(dout)
    grads = door.attention_with_lse_backward(dout, q, k, v, out, lse, False, mask, 0.4)
    assert all(torch.allclose(a, b.grad) for a, b in zip(grads, leaves))


def test_unflatten_mesh_splits_a_dimension_into_named_dims_of_the_root(world_of_one):
    mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("pp", "dp", "tp"))
    experts = door.unflatten_mesh(mesh["dp"], (1, 1), ("edp", "ep"))
    assert experts.mesh_dim_names == ("edp", "ep") and experts["ep"].size() == 1
    both = door.concatenate_meshes([experts["edp"], experts["ep"]])  # what FSDP does with an ep-sharded weight
    assert both.mesh_dim_names == ("edp", "ep")


def test_grouped_mm_multiplies_each_group_by_its_matrix():
    """Forward only on CPU (its CPU backward fails on torch 2.13: training on CPU uses the loop)."""
    x, w = torch.randn(10, 8), torch.randn(3, 8, 8)
    out = door.grouped_mm(x, w, torch.tensor([3, 3, 10], dtype=torch.int32))
    assert torch.allclose(out, torch.cat([x[:3] @ w[0], x[3:] @ w[2]]), atol=1e-6)


def test_collective_wait_clock_counts_the_waits_of_plain_and_functional_collectives(world_of_one):
    from torch.distributed._functional_collectives import all_reduce

    clock = door.collective_wait_clock()
    assert door.collective_wait_clock()() == clock()  # installed once: a second call shares the clock
    before = clock()
    dist.all_reduce(torch.ones(2), async_op=True).wait()  # c10d's Work.wait: plain and FSDP collectives
    after_plain = clock()
    all_reduce(torch.ones(2), "sum", dist.group.WORLD).wait()  # wait_tensor: DTensor's collectives
    assert before < after_plain < clock()


def test_pytree_logger_is_the_one_pytree_logs_through():
    import torch.utils._pytree as pytree

    from nanotron.parallel.torch_private import pytree_logger

    assert getattr(pytree, "log", pytree_logger()) is pytree_logger()  # torch 2.11 has no module attribute


def test_local_block_is_a_shards_global_offset_and_shape():
    """Rank 3 of a (2, 2) mesh holds rows 3-5 and columns 4-7 of a [6, 8] tensor sharded on both dims."""
    from torch.distributed.tensor import DTensor, Shard

    door.fake_process_group(rank=3, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        shard = DTensor.from_local(torch.zeros(3, 4), mesh, [Shard(0), Shard(1)], shape=(6, 8), stride=(8, 1))
        assert door.local_block(shard) == ((3, 4), (3, 4))
        assert door.local_block(torch.zeros(6, 8)) == ((0, 0), (6, 8))
    finally:
        dist.destroy_process_group()


def test_shard_block_at_gives_another_ranks_block():
    """From rank 0 of a (2, 2) mesh: rank (1, 1)'s block of a [6, 8] tensor sharded on both dims, as local_block."""
    from torch.distributed.tensor import DTensor, Shard

    door.fake_process_group(rank=0, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        shard = DTensor.from_local(torch.zeros(3, 4), mesh, [Shard(0), Shard(1)], shape=(6, 8), stride=(8, 1))
        assert door.shard_block_at(shard, [1, 1]) == ((3, 4), (3, 4))
        assert door.shard_block_at(shard, [0, 0]) == door.local_block(shard) == ((0, 0), (3, 4))
    finally:
        dist.destroy_process_group()


def test_stager_keeps_its_buffers_says_whether_a_dcp_stager_stages_a_second_time():
    """torch 2.13's DefaultStager refills its host buffers at every save (the manager keeps one per run); 2.11's
    empties itself after one stage, and a second fails (the manager then takes one per save)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from nanotron.checkpoint.torch_private import stager_keeps_its_buffers

    stager = DefaultStager(StagingOptions(False, False, False, False))
    state = {"w": torch.ones(4)}
    try:
        first = stager.stage(state)
        if stager_keeps_its_buffers():
            assert stager.stage(state)["w"].data_ptr() == first["w"].data_ptr()
        else:
            with pytest.raises(KeyError):
                stager.stage(state)
    finally:
        stager.close()


def test_forward_only_keeps_the_forward_sends_and_their_waits():
    """Evaluation runs a runtime schedule's forward actions alone. torch 2.15 pairs each send with a wait action
    and fails a step with a send left unwaited; the backward actions and their communication go."""
    from types import SimpleNamespace

    from nanotron.parallel.pipeline import forward_only

    def act(kind: str, sub_actions=None):
        return SimpleNamespace(computation_type=SimpleNamespace(value=kind), sub_actions=sub_actions)

    kinds = ["UNSHARD", "RECV_F", "F", "SEND_F", "WAIT_SEND_F", "RECV_B", "B", "SEND_B", "WAIT_SEND_B", "RESHARD"]
    overlapped = act("OVERLAP_F_B", [act("F"), act("B")])
    schedule = SimpleNamespace(pipeline_order_with_comms={0: [act(k) for k in kinds] + [overlapped, None]})
    with forward_only(schedule):
        kept = [a.computation_type.value for a in schedule.pipeline_order_with_comms[0]]
    assert kept == ["UNSHARD", "RECV_F", "F", "SEND_F", "WAIT_SEND_F", "RESHARD", "F"]
    assert len(schedule.pipeline_order_with_comms[0]) == len(kinds) + 2  # the training order is back
