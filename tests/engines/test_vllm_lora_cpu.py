"""The vLLM engine's LoRA adapter sync on CPU, with vLLM replaced by the fake of test_vllm_cpu.py:
the adapter tensors (only they) arrive through the transport, checksummed in the worker, are
written as a PEFT adapter directory and loaded with the worker's ``add_lora`` (in place), every
request then carries the adapter, the read-back matches the trainer, and a wake loads it again."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("peft")

from tests.engines.test_vllm_cpu import FakeLLM, engine_spec, vllm_module  # noqa: E402,F401 (fixture)
from xrlhf.algorithms.losses import SFTLoss  # noqa: E402
from xrlhf.data.batch import build_sequences  # noqa: E402
from xrlhf.engines.base import EngineSpec, SamplingParams  # noqa: E402
from xrlhf.engines.lora import LoraOptions  # noqa: E402
from xrlhf.weight_sync import build_transport, checksum, compare_checksums, push_weights  # noqa: E402


class FakeLoRARequest(SimpleNamespace):
    def __init__(self, lora_name, lora_int_id, lora_path="", load_inplace=False):
        super().__init__(lora_name=lora_name, lora_int_id=lora_int_id, lora_path=lora_path, load_inplace=load_inplace)


@pytest.fixture()
def fake_lora(monkeypatch):
    request = types.ModuleType("vllm.lora.request")
    request.LoRARequest = FakeLoRARequest
    monkeypatch.setitem(sys.modules, "vllm.lora", types.ModuleType("vllm.lora"))
    monkeypatch.setitem(sys.modules, "vllm.lora.request", request)
    generated = []

    def generate(self, prompts, sp, use_tqdm=True, lora_request=None):
        generated.append(lora_request)
        return FakeLLM._generate(self, prompts, sp)

    monkeypatch.setattr(FakeLLM, "generate", generate)
    return generated


def test_an_adapter_sync_loads_the_adapter_in_vllm_through_add_lora(vllm_module, tiny_model, fake_lora):
    from safetensors.torch import load_file

    from xrlhf.engines.hf import HFTrainEngine

    lora = {"rank": 4, "alpha": 8.0, "sync": "adapter"}
    engine = vllm_module.VLLMGenerateEngine(
        EngineSpec(tiny_model, options=engine_spec(tiny_model, sleep_level=1).options, seed=3,
                   adapter=LoraOptions(**lora)))
    llm = FakeLLM.last
    assert llm.kwargs["enable_lora"] and llm.kwargs["max_lora_rank"] == 8 and llm.kwargs["max_loras"] == 1
    loads = []
    worker = llm.worker
    worker.model_runner.lora_manager = SimpleNamespace()  # LoRA enabled
    worker.add_lora = lambda req: loads.append((req, load_file(f"{req.lora_path}/adapter_model.safetensors"),
                                                json.loads(Path(req.lora_path, "adapter_config.json").read_text())))
    base = {n: p.clone() for n, p in worker.model_runner.get_model().named_parameters()}
    engine.generate([[1, 5]], SamplingParams())
    assert fake_lora == [None]  # no adapter before the first sync: the base, which B = 0 leaves as it is

    t = HFTrainEngine(EngineSpec(tiny_model, options={"lr": 1e-2, "micro_batch_size": 4, "lora": lora}, seed=0))
    t.train_step(build_sequences([[1, 20, 21]] * 4, [[30, 2]] * 4, pad_id=0), SFTLoss())
    sent = {n: v.clone() for n, v in t.weights_for_sync()}
    engine.sleep()
    n = push_weights(build_transport("cpu", bucket_bytes=4096, verify=True), t.weights_for_sync(),
                     engine.receive_weights)
    engine.end_sync(1)
    assert n == len(sent) == 28
    (req, tensors, config), = loads
    assert req.load_inplace and req.lora_int_id == 1 and config["r"] == 4 and config["lora_alpha"] == 8.0
    assert tensors.keys() == sent.keys() and all(torch.equal(tensors[k], sent[k]) for k in sent)
    compare_checksums({k: checksum(v) for k, v in sent.items()}, engine.weight_checksums(), "vLLM")
    assert all(torch.equal(p, base[n]) for n, p in worker.model_runner.get_model().named_parameters())  # base kept
    engine.generate([[1, 5]], SamplingParams())
    assert fake_lora[-1].lora_int_id == 1 and fake_lora[-1].lora_path == req.lora_path
    engine.sleep()
    engine.wake_up()
    assert len(loads) == 2 and loads[-1][0].load_inplace  # loaded again after a wake
    engine.shutdown()
    assert not Path(req.lora_path).exists()  # the adapter directory goes with the engine
