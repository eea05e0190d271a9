"""Full weights over a process group (plainrl.rollout.engines.weight_group): bucket plans by
hand, packing of mixed dtypes, and a real broadcast to two receiving processes over gloo.
(The same code against a `plainrl serve` server: tests/test_vllm_remote.py, `make test-vllm`; the
trainer's side against receivers built by SGLang's own group and bucket code, also there.)"""

import io
import multiprocessing as mp
import time

import pytest
import torch

from plainrl.rollout.engines import weight_group as wg


def _tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(100, 8),                # 3200 bytes
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8).bfloat16(),  # 128
        "model.layers.0.self_attn.q_proj.bias": torch.randn(3),          # 12 -> 16 aligned
        "model.layers.1.mlp.up_proj.weight": torch.randn(8, 8),          # 256
        "model.norm.weight": torch.randn(8).half(),                      # 16
    }


def test_buckets_keep_whole_layers_and_respect_the_byte_cap():
    t = _tensors()
    buckets = wg.plan_buckets(t.items(), max_bytes=380)
    names = [[s.name for s in b] for b in buckets]
    # the embedding alone exceeds the cap: a bucket of its own; layer 0's two tensors (128 + 16 bytes)
    # stay together; layer 1 (256) does not fit beside them (144 + 256 > 380); the norm (16) joins it
    assert names == [["model.embed_tokens.weight"],
                     ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.bias"],
                     ["model.layers.1.mlp.up_proj.weight", "model.norm.weight"]]
    # a bucket ends where its last tensor does (the bias's 12 bytes from 128)
    assert [s.offset for s in buckets[1]] == [0, 128] and [wg.bucket_bytes(b) for b in buckets] == [3200, 140, 272]
    assert sum(len(b) for b in wg.plan_buckets(t.items())) == len(t) and len(wg.plan_buckets(t.items())) == 1
    with pytest.raises(ValueError, match="max_bytes"):
        wg.plan_buckets(t.items(), max_bytes=0)


def test_a_tight_bucket_has_no_padding_and_every_offset_a_multiple_of_its_element_size():
    # SGLang's FlattenedTensorBucket layout: tensors back to back, larger elements first
    t = {"model.layers.0.a": torch.randn(3).half(),     # 6 bytes
         "model.layers.0.b": torch.randn(3),            # 12 bytes, 4-byte elements
         "model.layers.0.c": torch.randn(5).bfloat16(),  # 10 bytes
         "model.layers.0.d": torch.randn(1).double()}   # 8 bytes, 8-byte elements
    [bucket] = wg.plan_buckets(t.items(), tight=True)
    # by element size 8, 4, 2, 2 (a before c: the order among equals is kept): 0, 8, 20, 26
    assert [(s.name[-1], s.offset) for s in bucket] == [("d", 0), ("b", 8), ("a", 20), ("c", 26)]
    assert wg.bucket_bytes(bucket) == 36 == sum(x.numel() * x.element_size() for x in t.values())
    got = dict(wg.unpack(bucket, wg.pack(bucket, t, torch.device("cpu"))))
    assert all(torch.equal(got[k], t[k]) for k in t)
    # the same tensors padded: each at a 16-byte boundary, in the given order
    assert [s.offset for s in wg.plan_buckets(t.items())[0]] == [0, 16, 32, 48]


def test_pack_and_unpack_round_trip_mixed_dtypes_through_the_json_layout():
    t = _tensors()
    buckets = wg.layout_from_json(wg.layout_json(wg.plan_buckets(t.items(), max_bytes=400)))
    got = {}
    for b in buckets:
        flat = wg.pack(b, t, torch.device("cpu"))
        assert flat.dtype == torch.uint8 and flat.numel() == wg.bucket_bytes(b)
        got.update(wg.unpack(b, flat.clone()))
    assert got.keys() == t.keys()
    for name, x in t.items():
        assert got[name].dtype == x.dtype and torch.equal(got[name], x), name


def _receive(port: int, rank: int, layout: str, out: "mp.Queue") -> None:
    group = wg.join_group("127.0.0.1", port, 3, rank, "gloo", timeout_s=60)
    got = {k: v.clone() for k, v in wg.receive(group, wg.layout_from_json(layout), torch.device("cpu"), 60)}
    buf = io.BytesIO()
    torch.save(got, buf)
    out.put(buf.getvalue())


def _with_receivers(group: wg.WeightGroup, target, args: tuple, send) -> list[dict[str, torch.Tensor]]:
    """Ranks 1.. of ``group`` as spawned processes running ``target(port, rank, *args, out)``;
    this process joins as rank 0 and calls ``send()``. Returns what each receiver got, once
    every receiver has exited 0."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(group.port, r, *args, out)) for r in range(1, group.world_size)]
    for p in procs:
        p.start()
    try:
        group.connect()
        send()
        received = [torch.load(io.BytesIO(out.get(timeout=120))) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        group.close()
    assert all(p.exitcode == 0 for p in procs)
    return received


def test_two_processes_receive_every_tensor_over_gloo():
    t = _tensors()
    buckets = wg.plan_buckets(t.items(), max_bytes=400)
    group = wg.WeightGroup("127.0.0.1", 3, "gloo", timeout_s=60)

    def send():
        assert group.send(t, buckets, torch.device("cpu")) == sum(wg.bucket_bytes(b) for b in buckets)

    for got in _with_receivers(group, _receive, (wg.layout_json(buckets),), send):
        assert got.keys() == t.keys() and all(torch.equal(got[k], t[k]) for k in t)


def test_a_receiver_that_never_joins_ends_the_rendezvous_with_an_error():
    group = wg.WeightGroup("127.0.0.1", 2, "gloo", timeout_s=2)
    start = time.monotonic()
    with pytest.raises(RuntimeError):  # torch's DistBackendError / DistStoreError are RuntimeErrors
        group.connect()
    assert time.monotonic() - start < 60  # bounded by the timeout, not a hang
    group.close()


def _sglang_receive(port: int, rank_offset: int, world_size: int, name: str, bodies: list, out: "mp.Queue") -> None:
    """An SGLang scheduler's side, through SGLang's own code (0.5.23): the group as
    ``WeightUpdater.init_weights_update_group`` forms it (``init_custom_process_group`` at
    ``rank_offset + tp_rank``, tp_rank 0 here), each bucket as
    ``_receive_bucketed_weights_from_distributed`` takes it (``FlattenedTensorBucket.empty`` from the
    request's names/dtypes/shapes, a broadcast from rank 0, ``reconstruct_tensors``)."""
    from sglang.srt.utils.common import init_custom_process_group
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    pg = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=world_size,
                                   rank=rank_offset, group_name=name)
    got = {}
    for body in bodies:
        assert body["load_format"] == "flattened_bucket" and body["group_name"] == name
        bucket = FlattenedTensorBucket.empty(body["names"], body["dtypes"], body["shapes"], "cpu")
        torch.distributed.broadcast(bucket.get_flattened_tensor(), src=0, group=pg)
        got.update((k, v.clone()) for k, v in bucket.reconstruct_tensors())
    buf = io.BytesIO()
    torch.save(got, buf)
    out.put(buf.getvalue())


@pytest.mark.vllm  # runs in `make test-vllm`, whose venv holds SGLang's package without its dependencies
def test_sglang_receivers_built_by_sglangs_own_code_get_every_tensor_from_the_trainers_group():
    pytest.importorskip("sglang.srt.utils.common", reason="SGLang's package is not installed (make setup-vllm adds it)")
    from plainrl.rollout.engines.sglang import distributed_body, sglang_prefixes

    t = _tensors()
    buckets = wg.plan_buckets(t.items(), max_bytes=400, tight=True)
    name = "plainrl-test-weights-1"
    bodies = [distributed_body(b, name, flush_cache=k == len(buckets) - 1) for k, b in enumerate(buckets)]
    assert [b["flush_cache"] for b in bodies] == [False] * (len(bodies) - 1) + [True]
    group = wg.WeightGroup("127.0.0.1", 3, "gloo", timeout_s=60, prefixes=sglang_prefixes(name, "gloo"),
                           sequence=True)

    def send():
        for b in buckets:
            wg.broadcast(group.group, wg.pack(b, t, torch.device("cpu")), 60)

    for got in _with_receivers(group, _sglang_receive, (3, name, bodies), send):
        assert got.keys() == t.keys()
        for k in t:
            assert got[k].dtype == t[k].dtype and torch.equal(got[k], t[k]), k
