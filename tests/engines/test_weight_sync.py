"""Weight-sync transports on CPU: buckets, flat buffers, checksums, the broadcast protocol (gloo)."""

from __future__ import annotations

import pickle
import socket

import pytest
import torch

from xrlhf.engines.weight_sync import (ALIGN, CPUTransport, InProcessTransport, Message, WeightSyncError, buckets,
                                       build_transport, checksum, compare_checksums, flat_layout, flatten,
                                       push_weights, unflatten)


def named(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [("a.weight", torch.randn(4, 3, generator=g)), ("b.bias", torch.randn(5, generator=g)),
            ("c.weight", torch.randn(7, 2, generator=g).to(torch.bfloat16)), ("d.scale", torch.randn(3, generator=g)),
            ("e.weight", torch.randn(64, 8, generator=g))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_buckets_respect_the_size_and_keep_order():
    weights = named()
    sizes = [t.numel() * t.element_size() for _, t in weights]
    out = list(buckets(weights, 64))
    assert [n for b in out for n, _ in b] == [n for n, _ in weights]
    for b in out:
        total = sum(t.numel() * t.element_size() for _, t in b)
        assert total <= 64 or len(b) == 1  # only a single tensor may exceed the bucket
    assert max(sizes) > 64 and len(out) >= 3


def test_flatten_roundtrip_mixed_dtypes_is_aligned():
    tensors = [torch.arange(3, dtype=torch.bfloat16), torch.arange(5, dtype=torch.float32).reshape(1, 5),
               torch.tensor([True, False, True]), torch.arange(6, dtype=torch.int64).reshape(2, 3)]
    buf, layout = flatten(tensors)
    assert buf.dtype == torch.uint8 and buf.numel() == layout["nbytes"]
    assert all(off % ALIGN == 0 for off in layout["offsets"])
    assert layout == flat_layout(tensors)
    assert layout["dtypes"] == ["bfloat16", "float32", "bool", "int64"]
    for a, b in zip(tensors, unflatten(buf, pickle.loads(pickle.dumps(layout)))):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int8, torch.bool])
def test_checksum_is_exact_and_order_sensitive(dtype):
    t = (torch.randn(1000) * 50).to(dtype) if dtype != torch.bool else torch.rand(1000) > 0.5
    before = t.clone()
    assert isinstance(checksum(t), int) and checksum(t) == checksum(t.clone())
    assert checksum(t) != checksum(t.flip(0))
    flipped = t.clone()
    flipped.view(torch.uint8)[123] ^= 1  # one bit
    assert checksum(flipped) != checksum(t)
    assert checksum(t.reshape(10, 100).t()) == checksum(t.reshape(10, 100).t().contiguous())
    assert checksum(torch.empty(0)) == 0
    assert torch.equal(t, before)  # the tensor is left as it was


@pytest.mark.parametrize("name", ["in_process", "cpu"])
def test_message_transport_verifies_and_casts(name):
    transport = build_transport(name, bucket_bytes=64, verify=True, dtype=torch.bfloat16)
    got = []
    n = push_weights(transport, named(), lambda t, msgs: sum(len(got.append(x) or x) for x in t.receive_all(msgs)))
    received = [pair for bucket in got for pair in bucket]
    assert n == len(named()) == len(received)
    for (name_a, a), (name_b, b) in zip(named(), received):
        assert name_a == name_b and b.dtype == torch.bfloat16
        assert torch.equal(a.to(torch.bfloat16), b)


def test_checksum_mismatch_names_the_tensor():
    transport = CPUTransport(verify=True)
    message = next(transport.send(named()))
    message.payload[1].view(torch.uint8)[0] ^= 1  # one bit corrupted in transit
    with pytest.raises(WeightSyncError, match="'b.bias'"):
        transport.receive(message)
    message.checksums = None  # verify off: no check
    assert len(transport.receive(message)) == len(message.names)


def test_receiver_gets_each_bucket_before_the_next_is_packed():
    events = []

    class Recording(InProcessTransport):
        def pack(self, tensors):
            events.append("pack")
            return tensors

    def receiver(transport, messages):
        events.append("load")
        return sum(len(b) for b in transport.receive_all(messages))

    assert push_weights(Recording(bucket_bytes=64), named(), receiver) == 5
    assert events == ["pack", "load"] * (len(events) // 2)


def test_compare_checksums_names_differences_and_missing():
    want = {"a": 1.0, "b": 2.0, "c": 3.0}
    compare_checksums(want, {"a": 1.0, "b": 2.0, "c": 3.0, "extra": 9.0})
    with pytest.raises(WeightSyncError, match=r"'b'.*missing in the generator: 'c'"):
        compare_checksums(want, {"a": 1.0, "b": 2.5})


def test_transports_pickle_without_live_state():
    ipc = build_transport("cuda_ipc", bucket_bytes=128, verify=True, packed=True)
    ipc._keep = [torch.zeros(3)]
    copy = pickle.loads(pickle.dumps(ipc))
    assert not hasattr(copy, "_keep") and copy.packed and copy.verify and copy.bucket_bytes == 128
    nccl = build_transport("nccl", host="127.0.0.1", port=1234, world_size=3, rank=0)
    nccl._group = object()
    peer = nccl.peer(rank=2)
    assert peer.rank == 2 and peer.world_size == 3 and not hasattr(peer, "_group") and nccl.rank == 0


def test_cuda_ipc_refuses_cpu_weights():
    transport = build_transport("cuda_ipc")
    with pytest.raises(WeightSyncError, match="not on a GPU"):
        next(transport.send(named()))


def test_broadcast_transport_over_gloo_sends_metadata_and_data():
    """The NCCL transport's protocol (store metadata + buffer broadcast + end marker) on gloo."""
    transport = build_transport("nccl", bucket_bytes=100, verify=True, host="127.0.0.1", port=free_port(),
                                world_size=2, rank=0, timeout_s=30)
    assert transport.kind == "broadcast"
    got = []

    def receiver(t, messages):
        assert messages is None and t.rank == 1
        for bucket in t.receive_all(None, "cpu"):
            got.extend(bucket)
        return len(got)

    weights = named()
    for _ in range(2):  # a second sync reuses both sides' connections
        got.clear()
        assert push_weights(transport, weights, receiver) == len(weights)
        assert [n for n, _ in got] == [n for n, _ in weights]
        for (_, a), (_, b) in zip(weights, got):
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_broadcast_metadata_message_carries_layout_and_checksums():
    transport = build_transport("nccl", bucket_bytes=1 << 20, verify=True)
    tensors = [t for _, t in named()]
    msg = Message(["x"] * len(tensors), None, [checksum(t) for t in tensors], flat_layout(tensors))
    msg.payload = flatten(tensors)[0]
    assert [n for n, _ in transport.receive(msg)] == msg.names
    msg.payload[0] ^= 1  # one flipped bit in the first tensor
    with pytest.raises(WeightSyncError, match="checksum"):
        transport.receive(msg)
