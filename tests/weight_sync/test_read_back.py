"""The weight read-back compares like with like: a loader that changes a tensor's layout (vLLM
transposes GPT-2's Conv1D weights) gives no false difference, and a real corruption is caught.

The generator here is the real vLLM worker extension (``xrlhf.engines.vllm.extension``, which imports
no vLLM at module level) on a fake model whose loader transposes Conv1D weights as vLLM's GPT-2
loader does; every call crosses a pickle boundary as it would to vLLM's engine process.
"""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from xrlhf.weight_sync import WeightSyncError, build_transport, checksum, compare_checksums

CONV1D = ("h.0.attn.c_attn.weight", "h.0.mlp.c_fc.weight")


def trainer_weights(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """GPT-2-like HF tensors: Conv1D weights are ``[in, out]``."""
    g = torch.Generator().manual_seed(seed)
    return [("wte.weight", torch.randn(10, 4, generator=g)), ("h.0.attn.c_attn.weight", torch.randn(4, 12, generator=g)),
            ("h.0.attn.c_attn.bias", torch.randn(12, generator=g)), ("h.0.mlp.c_fc.weight", torch.randn(4, 16, generator=g))]


def transposing_model() -> nn.Module:
    """vLLM's layout of the same model: Linear weights ``[out, in]``, so its loader transposes Conv1D ones."""
    model = nn.Module()
    for name, t in trainer_weights():
        model.register_parameter(name.replace(".", "_"), nn.Parameter(torch.zeros(t.shape[::-1] if name in CONV1D
                                                                                   else t.shape)))
    params = {n: getattr(model, n.replace(".", "_")) for n, _ in trainer_weights()}

    def load_weights(weights):
        with torch.no_grad():
            for name, t in weights:
                params[name].copy_(t.t() if name in CONV1D else t)
        return {name.replace(".", "_") for name, _ in weights}

    model.load_weights = load_weights
    return model


def worker():
    from xrlhf.engines.vllm.extension import XrlhfWorkerExtension

    model = transposing_model()
    cls = type("Worker", (XrlhfWorkerExtension,), {"_xrlhf_tp_rank": lambda self: 0})
    w = cls()
    w.device = torch.device("cpu")
    w.model_runner = SimpleNamespace(get_model=lambda: model)
    return w, model


def sync(w, weights, verify: bool = True) -> None:
    transport = build_transport("cpu", bucket_bytes=200, verify=verify)
    for message in transport.send(weights):
        w.xrlhf_receive(pickle.dumps((transport, [message])))  # the process boundary
    w.xrlhf_end_sync()


def test_a_transposing_loader_gives_no_false_difference_and_a_corruption_is_caught():
    w, model = worker()
    weights = trainer_weights(1)
    want = {n: checksum(t) for n, t in weights}
    sync(w, weights)
    hf_name = {n.replace(".", "_"): n for n in want}
    by_param = {hf_name[n]: checksum(p) for n, p in model.named_parameters()}
    with pytest.raises(WeightSyncError, match=r"2 differ.*c_attn\.weight"):
        compare_checksums(want, by_param)  # the parameters by name: what the old read-back compared
    compare_checksums(want, w.xrlhf_weight_checksums())  # what the loader was given: exact
    with torch.no_grad():
        model.h_0_attn_c_attn_weight.view(-1).view(torch.int32)[3] ^= 1  # one bit, after loading
    with pytest.raises(WeightSyncError, match=r"read-back \(vLLM\): 1 parameter\(s\) changed since the last sync "
                                              r"loaded them: h_0_attn_c_attn_weight"):
        w.xrlhf_weight_checksums()


def test_the_read_back_follows_the_last_sync_and_needs_it_verified():
    w, _ = worker()
    sync(w, trainer_weights(1))
    sync(w, trainer_weights(2))
    compare_checksums({n: checksum(t) for n, t in trainer_weights(2)}, w.xrlhf_weight_checksums())
    with pytest.raises(WeightSyncError, match="differ"):
        compare_checksums({n: checksum(t) for n, t in trainer_weights(1)}, w.xrlhf_weight_checksums())
    sync(w, trainer_weights(3), verify=False)  # an unverified sync leaves no stale record behind
    with pytest.raises(WeightSyncError, match="without verify"):
        w.xrlhf_weight_checksums()
    w.xrlhf_load_weights(trainer_weights(4))  # handed over directly: no checksums either
    w.xrlhf_end_sync()
    with pytest.raises(WeightSyncError, match="without verify"):
        w.xrlhf_weight_checksums()


def test_a_corruption_in_transit_is_caught_by_name_where_the_weights_land():
    w, _ = worker()
    transport = build_transport("cpu", verify=True)
    message = next(transport.send(trainer_weights()))
    message.payload[message.meta["offsets"][1]] ^= 1
    with pytest.raises(WeightSyncError, match="'h.0.attn.c_attn.weight' arrived with checksum"):
        w.xrlhf_receive(pickle.dumps((transport, [message])))
