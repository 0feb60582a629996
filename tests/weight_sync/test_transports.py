"""Weight-sync transports on CPU: buckets, flat buffers, checksums, every transport that runs on
CPU round-tripping with verify on (nccl over gloo), the disk transport's files, the lazy registry."""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

from xrlhf.weight_sync import (ALIGN, TRANSPORTS, Message, WeightSyncError, buckets, build_transport, checksum,
                               checksums, compare_checksums, flat_layout, flatten, push_weights, unflatten)


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


def _one_pass_checksum(t: torch.Tensor) -> int:
    """The checksum's definition, written out by hand: the element bits as integers, times an odd
    hash of the position, summed modulo 2**64 (as a signed int64)."""
    words = t.contiguous().reshape(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
        t.element_size()] if t.dtype != torch.bool else torch.uint8).tolist()
    total = sum(w * ((((i * 2654435761) + 0x9E3779B9) & 0xFFFFFFFF) | 1) for i, w in enumerate(words)) % (1 << 64)
    return total - (1 << 64) if total >= 1 << 63 else total


def test_checksums_in_passes_equal_the_definition(monkeypatch):
    """Passes of a few elements (a tensor larger than one pass), many tensors with one wait, an int64
    tensor left untouched, an empty tensor, a generator of converted copies: all as defined."""
    import xrlhf.weight_sync.base as base

    g = torch.Generator().manual_seed(0)
    tensors = [(torch.randn(37, generator=g) * 1e3).to(torch.bfloat16), torch.randn(5, 3, generator=g),
               torch.randint(-2**62, 2**62, (29,), generator=g), torch.randint(0, 255, (11,), generator=g).to(torch.uint8),
               torch.rand(13, generator=g) > 0.5, torch.empty(0), torch.randn(40, generator=g, dtype=torch.float64)]
    before = [t.clone() for t in tensors]
    want = [_one_pass_checksum(t) for t in tensors]
    assert checksums(tensors) == want  # one pass per tensor
    monkeypatch.setattr(base, "_CHUNK", 7)  # several passes per tensor
    assert checksums(tensors) == want
    assert [checksum(t) for t in tensors] == want
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))
    assert checksums(t.to(torch.bfloat16) for t in tensors[:2]) == [_one_pass_checksum(t.to(torch.bfloat16))
                                                                    for t in tensors[:2]]
    assert checksums([]) == []


def options(name: str, tmp_path) -> dict:
    """What each CPU-capable transport needs besides the shared options."""
    if name == "disk":
        return {"directory": str(tmp_path / "weights")}
    if name == "nccl":  # over gloo on CPU: the same protocol as on GPUs
        return {"host": "127.0.0.1", "port": free_port(), "world_size": 2, "rank": 0, "timeout_s": 30}
    return {}


def collect(got: list, through_pickle: bool):
    """A receiver that keeps what arrives (messages pickled first: the object store / vLLM path)."""
    def receiver(t, messages):
        if through_pickle and messages is not None:
            messages = pickle.loads(pickle.dumps(messages))
        n = 0
        for bucket in t.receive_all(messages, "cpu"):
            got.extend((name, x.clone()) for name, x in bucket)
            n += len(bucket)
        return n
    return receiver


@pytest.mark.parametrize("name", ["in_process", "cpu", "disk", "nccl"])
def test_every_cpu_transport_round_trips_with_verify_on(name, tmp_path):
    transport = build_transport(name, bucket_bytes=64, verify=True, dtype=torch.bfloat16, **options(name, tmp_path))
    weights = named()
    for seed in (1, 2):  # a second sync reuses buffers, files' directory, connections
        weights = named(seed)
        got: list = []
        assert push_weights(transport, weights, collect(got, through_pickle=name != "in_process")) == len(weights)
        assert [n for n, _ in got] == [n for n, _ in weights]
        for (_, a), (_, b) in zip(weights, got):
            assert b.dtype == torch.bfloat16 and b.shape == a.shape and torch.equal(a.to(torch.bfloat16), b)


def test_cpu_transport_sends_one_flat_buffer_per_bucket_and_reuses_it():
    transport = build_transport("cpu", bucket_bytes=1 << 20, verify=True)
    first = next(transport.send(named()))
    assert isinstance(first.payload, np.ndarray) and first.payload.dtype == np.uint8
    layout = {k: v for k, v in first.meta.items() if k != "shm"}  # + the shared file's name, where /dev/shm has room
    assert layout == flat_layout([t for _, t in named()]) and first.payload.nbytes == first.meta["nbytes"]
    second = next(transport.send(named(1)))
    assert np.shares_memory(first.payload, second.payload)  # bucket 0 of the next sync: the same host buffer
    assert [n for n, _ in transport.receive(pickle.loads(pickle.dumps(second)))] == second.names


def corrupt(name: str, message: Message, index: int) -> None:
    """Flip one bit of tensor ``index`` of a message where the transport keeps its data."""
    if name == "in_process":
        message.payload[index].view(torch.uint8).view(-1)[0] ^= 1
    elif name == "cpu":
        message.payload[message.meta["offsets"][index]] ^= 1
    else:  # disk: a byte of the file itself, found through its safetensors header
        with open(message.payload, "r+b") as f:
            n = int.from_bytes(f.read(8), "little")
            begin = json.loads(f.read(n))[message.names[index]]["data_offsets"][0]
            f.seek(8 + n + begin)
            byte = f.read(1)[0]
            f.seek(8 + n + begin)
            f.write(bytes([byte ^ 1]))


@pytest.mark.parametrize("name", ["in_process", "cpu", "disk"])
def test_a_corrupted_byte_is_caught_by_name(name, tmp_path):
    transport = build_transport(name, verify=True, **options(name, tmp_path))
    weights = [(n, t.clone()) for n, t in named()]
    message = next(transport.send(weights))
    corrupt(name, message, 1)
    with pytest.raises(WeightSyncError, match=f"weight sync \\({name}\\): tensor 'b.bias' arrived with checksum"):
        transport.receive(message)
    message.checksums = None  # verify off: no check
    assert len(transport.receive(message)) == len(message.names)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["cpu", "disk"])
def test_a_host_bucket_checked_for_a_gpu_receiver_is_checked_there(name, tmp_path):
    """Verified buckets of host memory reach a GPU receiver on its GPU (checksummed there, not by
    the host), equal to what was sent; unverified ones stay where the transport put them."""
    for verify in (True, False):
        transport = build_transport(name, verify=verify, **options(name, tmp_path))
        message = next(transport.send([(n, t.to("cuda")) for n, t in named()]))
        got = transport.receive(message, "cuda:0")
        assert [t.device.type for _, t in got] == ["cuda" if verify else "cpu"] * len(got)
        assert all(torch.equal(a, b.cpu()) for (_, a), (_, b) in zip(named(), got))


def test_receiver_gets_each_bucket_before_the_next_is_packed():
    events = []

    class Recording(TRANSPORTS.get("in_process")):
        def pack(self, tensors, names, index):
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


def test_cuda_ipc_refuses_handles_of_its_own_process():
    """A process cannot map its own CUDA IPC handles (an in-process vLLM engine beside its trainer):
    one line naming the fix, before any GPU is touched. A forked child (the fork server's workers)
    is another process."""
    from xrlhf.weight_sync.cuda_ipc import process_key

    message = Message(["w"], {"uuid": "GPU-0", "process": process_key(), "handles": []})
    with pytest.raises(WeightSyncError, match="cannot map its own CUDA IPC handles; use transport in_process"):
        build_transport("cuda_ipc").unpack(message)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its key, then gone without running the parent's exit handlers
        os.write(write, process_key().encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 200).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert child and child != process_key()


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
    assert transport.setup_seconds is None
    for _ in range(2):  # a second sync reuses both sides' connections
        got.clear()
        assert push_weights(transport, weights, receiver) == len(weights)
        assert [n for n, _ in got] == [n for n, _ in weights]
        for (_, a), (_, b) in zip(weights, got):
            assert a.dtype == b.dtype and torch.equal(a, b)
        assert transport.setup_seconds > 0  # opening the group, timed once, apart from the syncs


def test_broadcast_metadata_message_carries_layout_and_checksums():
    transport = build_transport("nccl", bucket_bytes=1 << 20, verify=True)
    tensors = [t for _, t in named()]
    msg = Message(["x"] * len(tensors), None, [checksum(t) for t in tensors], flat_layout(tensors))
    msg.payload = flatten(tensors)[0]
    assert [n for n, _ in transport.receive(msg)] == msg.names
    msg.payload[0] ^= 1  # one flipped bit in the first tensor
    with pytest.raises(WeightSyncError, match="checksum"):
        transport.receive(msg)


# -- disk ------------------------------------------------------------------------------------------
def test_disk_files_are_safetensors_and_a_sync_deletes_the_last_ones(tmp_path):
    from safetensors import safe_open

    directory = tmp_path / "shared"
    transport = build_transport("disk", bucket_bytes=64, directory=str(directory))
    weights = named()
    first = list(transport.send(weights))
    assert [m.payload for m in first] == transport.files and len(first) >= 3
    for m in first:  # plain safetensors: readable by the library, names and values intact
        with safe_open(m.payload, "pt") as f:
            assert list(f.keys()) == m.names
            for n in m.names:
                assert torch.equal(f.get_tensor(n), dict(weights)[n])
    second = list(transport.send(named(1)))
    assert not any(os.path.exists(m.payload) for m in first)  # the sync before is over: its files go
    assert sorted(os.listdir(directory)) == sorted(os.path.basename(m.payload) for m in second)
    del transport, first, second  # the sender goes: its last files go too, a given directory stays
    import gc

    gc.collect()
    assert directory.is_dir() and os.listdir(directory) == []


def test_disk_default_directory_is_made_and_removed_by_the_sender():
    transport = build_transport("disk")
    path = os.path.dirname(next(transport.send(named())).payload)
    assert os.path.isdir(path) and os.path.basename(path).startswith("xrlhf-weights-")
    del transport
    import gc

    gc.collect()
    assert not os.path.exists(path)


def test_disk_writes_atomically(tmp_path, monkeypatch):
    import xrlhf.weight_sync.disk as disk

    seen = []
    replace = os.replace

    def watched(src, dst):
        seen.append((os.path.exists(src), os.path.exists(dst), src.endswith(".tmp")))
        seen.append(list(disk.read_safetensors(src)))  # complete before it gets the name receivers read
        replace(src, dst)

    monkeypatch.setattr(disk.os, "replace", watched)
    transport = build_transport("disk", directory=str(tmp_path))
    message = next(transport.send(named()))
    assert seen == [(True, False, True), message.names]
    assert os.listdir(tmp_path) == [os.path.basename(message.payload)]  # no temporary file left


def test_disk_reads_shared_misaligned_and_tied_tensors(tmp_path):
    from xrlhf.weight_sync.disk import read_safetensors, write_safetensors

    emb = torch.randn(5, 3)
    odd = torch.arange(3, dtype=torch.bfloat16)  # 6 bytes: the next tensor starts misaligned
    names, tensors = ["emb", "odd", "after", "lm_head", "flag"], [emb, odd, torch.randn(4), emb, torch.ones(2) > 0]
    write_safetensors(str(tmp_path / "x.safetensors"), names, tensors)  # tied: two names, one storage
    got = read_safetensors(str(tmp_path / "x.safetensors"))
    assert list(got) == names
    for n, t in zip(names, tensors):
        assert got[n].dtype == t.dtype and torch.equal(got[n], t)


def test_disk_errors_name_the_directory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(WeightSyncError, match="cannot create .*policy.weight_sync.directory"):
        next(build_transport("disk", directory=str(blocker / "sub")).send(named()))
    transport = build_transport("disk", directory=str(tmp_path / "w"))
    message = next(transport.send(named()))
    os.remove(message.payload)
    with pytest.raises(WeightSyncError, match="cannot read .*under the same path"):
        transport.receive(message)


# -- the registry ----------------------------------------------------------------------------------
def test_unknown_transport_or_option_lists_the_valid_ones():
    with pytest.raises(KeyError, match="unknown weight-sync transport 'tcp'; valid: cpu, cuda_ipc, disk, in_process, "
                                       "nccl"):
        build_transport("tcp")
    with pytest.raises(ValueError, match="transport 'cpu' takes no option 'directory' .*bucket_bytes, verify, dtype"):
        build_transport("cpu", directory="/tmp")


def test_the_package_is_a_leaf_and_imports_a_transport_only_when_asked():
    code = ("import sys, xrlhf.weight_sync as w\n"
            "assert not [m for m in sys.modules if m.startswith(('xrlhf.engines', 'xrlhf.coordinator', 'ray', 'vllm'))]\n"
            "assert 'xrlhf.weight_sync.disk' not in sys.modules\n"
            "w.build_transport('disk')\n"
            "print(sorted(m for m in sys.modules if m.startswith('xrlhf.weight_sync.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['xrlhf.weight_sync.base', 'xrlhf.weight_sync.disk', 'xrlhf.weight_sync.memory']"
