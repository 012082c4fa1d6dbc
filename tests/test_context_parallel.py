"""Context parallelism's pieces against plain math: the zigzag split, document ids, and ring attention (forward
and backward, float64) over real gloo process groups of 2 and 4 ranks against a naive full attention."""

from __future__ import annotations

import os
import re
import socket
import time

import pytest
import torch
import torch.distributed as dist
from conftest import TINY_MODEL, run_train, train_losses
from matrix import DOCUMENTS, Layout, assert_matches

from nanotron.models.attention import DotProductAttention, document_ids
from nanotron.parallel import context
from nanotron.parallel.context import RingAttention, shard_sequence, zigzag_positions

BATCH, HEADS, KV_HEADS, SEQ, DIM, SCALE = 2, 4, 2, 48, 8, 0.3


def test_zigzag_gives_every_rank_two_chunks_and_equal_causal_work():
    for cp in (1, 2, 3, 4):
        parts = [zigzag_positions(SEQ, cp, r) for r in range(cp)]
        assert sorted(torch.cat(parts).tolist()) == list(range(SEQ))
        work = [int(p.sum()) + len(p) for p in parts]  # keys visible to a rank's queries under the causal mask
        assert len(set(work)) == 1
        x = torch.arange(SEQ).expand(3, SEQ)
        assert all(torch.equal(shard_sequence(x, cp, r), parts[r].expand(3, -1)) for r in range(cp))


def test_document_ids_count_the_eos_tokens_before_each_token():
    eos = 7
    ids = document_ids(torch.tensor([[1, 2, 7, 3, 7, 7, 4]]), eos)
    assert ids.tolist() == [[0, 0, 0, 1, 1, 2, 3]]


def naive_attention(q, k, v, doc):
    """The full masked softmax in float64, GQA by repetition: the reference."""
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    scores = (q @ k.transpose(-1, -2)) * SCALE
    seq = q.shape[2]
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()
    if doc is not None:
        mask = mask & (doc[:, None, :, None] == doc[:, None, None, :])
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, HEADS, SEQ, DIM, dtype=torch.float64, generator=g)
    k, v = (torch.randn(BATCH, KV_HEADS, SEQ, DIM, dtype=torch.float64, generator=g) for _ in range(2))
    dout = torch.randn(BATCH, HEADS, SEQ, DIM, dtype=torch.float64, generator=g)
    # Documents of odd lengths that cross chunk boundaries at cp 2 and 4 (chunks of 12 and 6 tokens), a
    # one-token document, and one that spans almost a whole chunk pair.
    tokens = torch.ones(BATCH, SEQ, dtype=torch.long)
    for b, ends in enumerate(([4, 5, 17, 30, 31, 40], [0, 13, 22, 23, 45])):
        tokens[b, ends] = 0
    return q, k, v, dout, document_ids(tokens, eos_id=0)


def reference_grads(doc):
    q, k, v, dout, _ = inputs()
    return reference_grads_of(q, k, v, dout, doc)


def reference_grads_of(q, k, v, dout, doc):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = naive_attention(q, k, v, doc)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _ring_worker(rank: int, cp: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=cp)
    chosen, results = context.block_kernel, {}
    for kernel in ("cpu_kernel", "reference_path"):  # the fused CPU kernel; the plain matmuls other devices run
        context.block_kernel = chosen if kernel == "cpu_kernel" else (lambda q, masked: "matmul")
        for masking in ("causal", "document"):
            q, k, v, dout, doc = inputs()
            q, k, v = (shard_sequence(x, cp, rank, dim=2).clone().requires_grad_() for x in (q, k, v))
            ring = RingAttention(SCALE, dist.group.WORLD, cp, rank)
            out = ring(q, k, v, doc if masking == "document" else None)
            out.backward(shard_sequence(dout, cp, rank, dim=2))
            # numpy arrays travel by value (a torch tensor's shared memory dies with this process)
            results[kernel, masking] = [t.detach().numpy() for t in (out, q.grad, k.grad, v.grad)]
    queue.put((rank, results))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_equals_full_attention_in_float64(cp, forkserver):
    queue = forkserver.Queue()
    port = _free_port()
    procs = [forkserver.Process(target=_ring_worker, args=(r, cp, port, queue)) for r in range(cp)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    doc = inputs()[4]
    for masking in ("causal", "document"):
        expected = reference_grads(doc if masking == "document" else None)
        for kernel in ("cpu_kernel", "reference_path"):
            for i, name in enumerate(("out", "dq", "dk", "dv")):
                for rank in range(cp):
                    got = torch.from_numpy(results[rank][kernel, masking][i])
                    want = shard_sequence(expected[i], cp, rank, dim=2)
                    err = (got - want).abs().max().item()
                    assert err <= 1e-10, f"{kernel} {masking} {name} rank {rank}: max error {err:.2e}"


def test_one_rank_attention_with_documents_equals_the_naive_reference():
    q, k, v, _, doc = inputs()
    out = DotProductAttention(SCALE)(q, k, v, doc)
    assert (out - naive_attention(q, k, v, doc)).abs().max() <= 1e-12
    assert (DotProductAttention(SCALE)(q, k, v) - naive_attention(q, k, v, None)).abs().max() <= 1e-12


# ---- the layout matrix: document masking on, every cp layout held to one process ---------------------------

CP_LAYOUTS = [
    Layout(cp=2),
    Layout(dp=2, cp=2, flags=("--parallelism.zero_stage=3",)),
    Layout(cp=2, tp=2, flags=("--parallelism.tp_mode=reduce_scatter", "--parallelism.sp_regather=on")),
    Layout(cp=2, pp=2, flags=("--parallelism.pp_engine=1f1b",)),
    Layout(cp=2, tp=2, pp=2, flags=("--parallelism.recompute=full",)),
]


@pytest.mark.slow
@pytest.mark.parametrize("layout", CP_LAYOUTS, ids=str)
def test_cp_layout_matches_one_process(layout, references, short_docs_data, tmp_path):
    ref = references[DOCUMENTS]
    run = DOCUMENTS.run(short_docs_data, tmp_path, "run", layout)
    assert len(ref.series("eval_loss")) == 2 and sorted(ref.stats) == [2, 4]
    print(f"{layout}: {assert_matches(run, ref, DOCUMENTS)}")


@pytest.mark.slow
def test_cp2_checkpoint_resumes_at_cp1_dp2_like_an_uninterrupted_run(short_docs_data, tmp_path):
    """Saved at cp2, resumed at cp1 x dp2 (weights, optimizer state and data position resharded): steps 3-4
    are the uninterrupted cp2 run's."""
    common = [
        *TINY_MODEL,
        *short_docs_data.overrides(),
        f"--job.out_dir={tmp_path}",
        "--checkpoint.save_final=true",
        "--model.attention=document",
        "--optimizer.decay_steps=4",
    ]
    cp2 = ["--parallelism.cp=2"]
    run_train([*common, "--job.name=reference", "--training.steps=4", "--checkpoint.interval=2", *cp2], nproc=2)
    resume = f"--checkpoint.resume_from={tmp_path / 'reference' / 'checkpoints' / 'step-2'}"  # saved at cp2
    run_train([*common, "--job.name=second", "--training.steps=4", "--parallelism.dp=2", resume], nproc=2)
    reference, resumed = train_losses(tmp_path / "reference"), train_losses(tmp_path / "second")
    assert len(reference) == 4 and len(resumed) == 2
    print("resumed vs uninterrupted:", [abs(a - b) / b for a, b in zip(resumed, reference[2:])])
    assert resumed == pytest.approx(reference[2:], rel=1e-7, abs=0)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            {"parallelism.cp": "4", "training.seq_len": "36"},
            "training.seq_len=36 must be divisible by 2*parallelism.cp = 8",
        ),
        (
            {"parallelism.cp": "2", "parallelism.tp": "4", "model.num_kv_heads": "4", "training.seq_len": "12"},
            "training.seq_len/cp = 12/2 must be divisible by parallelism.tp=4",
        ),
        (
            {"parallelism.cp": "2", "parallelism.tp": "2", "parallelism.tp_linear_async_communication": "true"},
            "parallelism.tp_linear_async_communication with parallelism.cp > 1 is not supported",
        ),
        ({"parallelism.cp": "0"}, "parallelism.cp: expected a value >= 1, got 0"),
        ({"model.attention": "sliding"}, "model.attention: expected one of 'causal', 'document', got 'sliding'"),
    ],
)
def test_bad_cp_configs_name_the_key(overrides, expected):
    from nanotron.config import load_config
    from nanotron.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(expected)):
        load_config("configs/tiny.toml", list(overrides.items()))


def test_ring_attention_takes_sdpas_default_scale_when_none_on_both_kernels(monkeypatch):
    """Standard parametrization passes scale None (SDPA's 1/sqrt(head_dim)); the ring, with its ranks as threads
    (benchmarks.cp_check), must use the same on the fused and the matmul kernel."""
    from benchmarks.cp_check import run_ring

    q, k, v, _, _ = inputs()
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    for kernel in ("cpu_flash", "matmul"):
        monkeypatch.setattr(context, "block_kernel", lambda t, masked, kernel=kernel: kernel)
        outs = run_ring(
            2, lambda r: RingAttention(None, None, 2, r)(*(shard_sequence(x, 2, r, dim=2) for x in (q, k, v)))
        )
        for rank, out in enumerate(outs):
            assert (out - shard_sequence(expected, 2, rank, dim=2)).abs().max() <= 1e-10


def test_the_in_process_ring_runs_each_ranks_backward_on_its_thread_and_a_stuck_ring_is_an_error():
    """On CUDA autograd runs backward on one worker thread per device unless the calling thread turns that off:
    two cp ranks as threads would then wait for each other's gradients on one thread, for good (gpu_check's cp
    attention row). Each rank's thread turns it off; a rank that never gets its peer's block ends the ring in
    `timeout`, as an error."""
    from benchmarks.cp_check import run_ring

    original = context._Ring
    assert run_ring(2, lambda rank: torch._C._is_multithreading_enabled()) == [False, False]

    def lonely(rank):  # rank 1 never sends: rank 0 waits for its block
        return context._Ring(torch.zeros(1), None, 2, rank).wait() if rank == 0 else None

    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"cp ranks \[0\] of the in-process ring still run after 1 s"):
        run_ring(2, lonely, timeout=1)
    assert time.monotonic() - start < 10
    assert context._Ring is original


# ---- the ring's block kernels: which one runs where, and the fused ones' numerics -------------------------


@pytest.mark.parametrize(
    "device, dtype, head_dim, masked, capability, expected",
    [
        ("cpu", torch.float64, 64, True, None, "cpu_flash"),  # the CPU kernel takes every dtype and masks
        ("cuda", torch.bfloat16, 64, False, (9, 0), "flash"),
        ("cuda", torch.float16, 256, False, (8, 0), "flash"),
        ("cuda", torch.bfloat16, 64, True, (9, 0), "efficient"),  # flash takes no mask: documents go here
        ("cuda", torch.bfloat16, 64, False, (7, 5), "efficient"),  # no flash before sm80
        ("cuda", torch.bfloat16, 512, False, (9, 0), "efficient"),  # flash stops at head dim 256
        ("cuda", torch.float32, 64, False, (9, 0), "efficient"),
        ("cuda", torch.float64, 64, False, (9, 0), "matmul"),  # no fused fp64 kernel: the exact reference
        ("cuda", torch.bfloat16, 60, False, (9, 0), "matmul"),  # head dim not a multiple of 8
        ("mps", torch.float32, 64, False, None, "matmul"),
    ],
)
def test_ring_block_kernel_is_chosen_by_device_dtype_head_dim_and_mask(
    device, dtype, head_dim, masked, capability, expected
):
    assert context.choose_block_kernel(device, dtype, head_dim, masked, capability) == expected


def test_fused_ring_blocks_merge_by_their_log_sum_exp_to_float64_within_the_matmul_paths_error():
    """The CPU fused kernel through the ring (ranks as threads) in bf16 and fp32, cp 2 and 4, causal and document
    masks: output and gradients no further from float64 than KERNEL_ERROR_RATIO times the matmul path's error
    (the check the GPU runs on its own kernels, benchmarks.cp_check)."""
    from benchmarks.cp_check import kernel_numerics

    assert kernel_numerics("cpu")


@pytest.mark.parametrize("kernel, masked", [("flash", False), ("efficient", False), ("efficient", True)])
def test_cuda_block_kernels_are_called_with_the_shapes_the_ring_merges(kernel, masked, monkeypatch):
    """The CUDA kernels' calls, checked with torch's meta kernels: the arguments parse, and the log-sum-exp comes
    back [batch, heads, rows] in fp32 (memory-efficient pads it to 32 rows: cut) with gradients of the inputs'
    shapes (flash takes no mask: the selection above never gives it one)."""
    monkeypatch.setattr(context, "block_kernel", lambda q, m: kernel)
    meta = dict(device="meta", dtype=torch.bfloat16)
    q, dout = torch.empty(2, 4, 40, 16, **meta), torch.empty(2, 4, 40, 16, **meta)
    k, v = torch.empty(2, 2, 24, 16, **meta), torch.empty(2, 2, 24, 16, **meta)
    mask = torch.empty(2, 1, 40, 24, dtype=torch.bool, device="meta") if masked else None
    out, lse = context._block_forward(q, k, v, False, mask, 0.25)
    assert out.shape == q.shape and lse.shape == (2, 4, 40) and lse.dtype == torch.float32
    grads = context._block_backward(dout, q, k, v, out, lse, False, mask, 0.25)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


# ---- FlexAttention's document block masks (CUDA's path; forward checked here, backward on the GPU) -------------


def document_cases() -> dict[str, torch.Tensor]:
    """Document ids of the mask shapes that break a block mask: documents crossing the cp chunk boundaries (chunks
    of 12 tokens at cp 2, 6 at cp 4), a document longer than a chunk pair, and chunks of only EOS tokens."""
    long_document = torch.ones(BATCH, SEQ, dtype=torch.long)
    long_document[:, [2, 44]] = 0
    only_eos = torch.ones(BATCH, SEQ, dtype=torch.long)
    only_eos[:, 12:24] = 0
    only_eos[1, 40] = 0
    return {
        "crossing chunks": inputs()[4],
        "longer than a chunk": document_ids(long_document, eos_id=0),
        "a chunk of only EOS": document_ids(only_eos, eos_id=0),
    }


def test_document_kernel_is_flex_on_cuda_only():
    from nanotron.models.attention import document_kernel

    assert document_kernel("cuda") == "flex" and document_kernel("cpu") == "mask"


@pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile")
@pytest.mark.parametrize("case", list(document_cases()))
def test_flex_document_attention_forward_equals_the_boolean_mask_path(case):
    from nanotron.models.attention import cached_document_block_mask, flex

    q, k, v, _, _ = inputs()
    doc = document_cases()[case]
    positions = torch.arange(SEQ)
    mask = cached_document_block_mask(doc, "sequence", positions, positions)
    assert mask is cached_document_block_mask(doc, "sequence", positions, positions)  # once per microbatch
    got = flex(q, k, v, mask, SCALE, compiled=False)
    assert (got - DotProductAttention(SCALE)(q, k, v, doc)).abs().max() <= 1e-12


@pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile")
def test_flex_ring_blocks_equal_the_masked_blocks_at_every_mask_shape():
    """Every visible ring block (each rank's queries against each source's keys), through FlexAttention with the
    block mask of its global positions, against the boolean-mask block the ring trains with: output and
    log-sum-exp (-inf where a row's document has no key in the block). cp 4: chunks of 6 tokens, so every case
    crosses chunks, and two whole chunks are EOS (cp 2 runs in gpu_check's CPU smoke test)."""
    cp = 4
    q, k, v, _, _ = inputs()
    for case, doc in document_cases().items():
        for rank in range(cp):
            local_q = shard_sequence(q, cp, rank, dim=2)
            for source in range(cp):
                local_k, local_v = (shard_sequence(x, cp, source, dim=2) for x in (k, v))
                out, lse = context.flex_block_forward(local_q, local_k, local_v, doc, cp, rank, source, SCALE)
                rows, cols, causal = context.block_plan(cp, rank, source, local_q.shape[2])
                mask = context._block_mask(doc, cp, rank, source, rows, cols, causal)
                want_out, want_lse = context._block_forward(
                    local_q[:, :, rows], local_k[:, :, cols], local_v[:, :, cols], causal, mask, SCALE
                )
                where = f"{case}, cp {cp}, rank {rank} against {source}"
                assert torch.equal(lse.isinf(), want_lse.isinf()), where
                assert (lse - want_lse).nan_to_num(0.0).abs().max() <= 1e-12, where
                assert (out - want_out).abs().max() <= 1e-12, where


@pytest.mark.parametrize("fused", [True, False])
def test_ring_attention_with_values_narrower_than_keys_equals_full_attention(monkeypatch, fused):
    """Multi-head latent attention's values are narrower than its queries and keys (v_head_dim 6 < 12 here): the
    ring carries K and V joined on the head dim, and the fused CPU kernel (which wants equal widths) gets zero-padded
    values. Output and every gradient equal the float64 full attention, with documents crossing the chunks."""
    from benchmarks.cp_check import run_ring

    q, k, v, dout, doc = inputs()
    v, dout = v[..., :6].contiguous(), dout[..., :6].contiguous()
    expected = reference_grads_of(q, k, v, dout, doc)
    monkeypatch.setattr(context, "block_kernel", lambda q, masked: "cpu_flash" if fused else "matmul")

    def work(rank):
        local = [shard_sequence(x, 2, rank, dim=2).clone().requires_grad_() for x in (q, k, v)]
        out = RingAttention(SCALE, None, 2, rank)(*local, doc)
        out.backward(shard_sequence(dout, 2, rank, dim=2))
        return [out.detach()] + [x.grad for x in local]

    for rank, got in enumerate(run_ring(2, work)):
        for name, g, want in zip(("out", "dq", "dk", "dv"), got, expected):
            err = (g - shard_sequence(want, 2, rank, dim=2)).abs().max().item()
            assert g.shape == shard_sequence(want, 2, rank, dim=2).shape and err <= 1e-10, f"{name} rank {rank}: {err}"
