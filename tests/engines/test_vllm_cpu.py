"""The vLLM engine's own logic on CPU, with vLLM replaced by a small fake.

The fake ``LLM`` runs the real worker extension (``xrlhf.engines.vllm.extension``) on a model laid
out as vLLM lays out a Llama (q/k/v and gate/up fused), and every ``collective_rpc`` argument
crosses a pickle boundary as it would to vLLM's engine process. What it checks: the mapping
of our config and sampling parameters to vLLM's, the sleep/wake order around a sync, weights
loaded inside the worker with checksums verified there, read-back of fused weights by HF
name, the completeness check, and that vLLM itself is never needed to import xrlhf. Its
``llm_engine`` (``FakeLLMEngine``) streams requests as vLLM's does for the request loop's tests
(tests/engines/test_vllm_loop.py).
"""

from __future__ import annotations

import importlib.machinery
import os
import importlib.util
import pickle
import queue
import subprocess
import sys
import threading
import types
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

import pytest
import torch
from torch import nn

from xrlhf import internals
from xrlhf.engines.base import EngineSpec, SamplingParams
from xrlhf.weight_sync import WeightSyncError, build_transport, checksum, compare_checksums, push_weights

REAL_VLLM = importlib.util.find_spec("vllm") is not None


def test_engines_import_without_vllm_and_choosing_it_says_how_to_install():
    code = ("import sys, xrlhf.engines, xrlhf.engines.base as b, xrlhf.weight_sync, xrlhf.engines.vllm.extension\n"
            "import xrlhf.engines.vllm.loop, xrlhf.engines.vllm.options\n"
            "cls = b.engine_class('vllm', 'generate')\n"  # the registry finds the package by the backend's name
            "print(cls.__module__, 'generate' in b.engine_names('generate'), 'vllm' in b.engine_names('generate'))\n"
            "assert 'vllm' not in sys.modules\n"
            "try:\n    b.build_engine('vllm', b.EngineSpec('x'), 'generate')\nexcept KeyError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[0] == "xrlhf.engines.vllm.engine False True"
    if not REAL_VLLM:
        assert "pip install -e '.[gpu]'" in out and "vllm" in out


# -- a fake vLLM ---------------------------------------------------------------------------------
def fused_like_vllm(hf: nn.Module) -> nn.Module:
    """A module tree with vLLM's parameter names for a Llama, initialised from ``hf``."""
    root = nn.Module()
    root.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    sd = hf.state_dict()

    def module(path: str) -> nn.Module:
        node = root
        for part in path.split("."):
            if not hasattr(node, part):
                node.add_module(part, nn.Module())
            node = getattr(node, part)
        return node

    for name, t in sd.items():
        if name == "lm_head.weight":
            continue
        path, _, leaf = name.rpartition(".")
        parent, _, last = path.rpartition(".")
        for fused, parts in root.packed_modules_mapping.items():
            if last in parts:
                mod = module(f"{parent}.{fused}")
                if not hasattr(mod, "output_partition_sizes"):
                    mod.output_partition_sizes = [sd[f"{parent}.{p}.{leaf}"].shape[0] for p in parts]
                    mod.register_parameter(leaf, nn.Parameter(torch.cat([sd[f"{parent}.{p}.{leaf}"] for p in parts])))
                break
        else:
            module(path).register_parameter(leaf, nn.Parameter(t.clone()))
    module("lm_head").register_parameter("weight", root.model.embed_tokens.weight)  # tied, as vLLM ties
    root.config = hf.config  # vLLM's models keep the HF config

    def load_weights(weights):
        loaded = set()
        params = dict(root.named_parameters())
        weights = list(weights)
        names = {n for n, _ in weights}
        if "lm_head.weight" in names and "model.embed_tokens.weight" not in names:  # vLLM 0.33's check, per call
            raise ValueError("'lm_head.weight' was skipped because it is tied to 'model.embed_tokens.weight', but "
                             "'model.embed_tokens.weight' was not found in the checkpoint")
        with torch.no_grad():
            for name, t in weights:
                if name == "lm_head.weight":
                    continue  # vLLM skips it when embeddings are tied
                path, _, leaf = name.rpartition(".")
                parent, _, last = path.rpartition(".")
                for fused, parts in root.packed_modules_mapping.items():
                    if last in parts:
                        target = f"{parent}.{fused}.{leaf}"
                        sizes = module(f"{parent}.{fused}").output_partition_sizes
                        i = parts.index(last)
                        params[target][sum(sizes[:i]):sum(sizes[:i + 1])].copy_(t)
                        break
                else:
                    target = name
                    params[target].copy_(t)
                loaded.add(target)
        return loaded

    root.load_weights = lambda weights: load_weights(weights)
    return root


@dataclass
class FakeSamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop_token_ids: list = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    flat_logprobs: bool = False
    detokenize: bool = True
    seed: int | None = None
    output_kind: str = "CUMULATIVE"


def fake_token(prompt: list[int], weights: int, kv: int, position: int) -> int:
    """What ``FakeLLMEngine`` samples: the prompt's last id, the weights that sampled the token
    (syncs finished), the weights of its KV cache, the position, in decimal digits."""
    return prompt[-1] * 10000 + weights * 1000 + kv * 100 + position


def token_weights(token: int) -> int:
    return token // 1000 % 10


def token_kv(token: int) -> int:
    return token // 100 % 10


class FakeSampler:
    """vLLM's V2 ``Sampler`` as ``record.install`` sees it: ``add_request`` and ``sample`` (greedy
    over the logits it is given, which are also its "processed" logits)."""

    def __init__(self):
        self.req_states = SimpleNamespace(index_to_req_id={})
        self.use_flashinfer = True
        self.params: dict[int, object] = {}

    def add_request(self, req_idx, prompt_len, sampling_params):
        self.params[req_idx] = sampling_params

    def sample(self, logits, expanded_idx_mapping, idx_mapping_np, pos, input_ids, expanded_local_pos,
               return_logprobs=False):
        return logits.argmax(-1), logits


@dataclass
class FakeRequest:
    prompt: list[int]
    params: FakeSamplingParams
    kv: int  # the weights its KV cache was computed with
    produced: int = 0
    tokens: list = field(default_factory=list)  # all so far (FINAL_ONLY outputs carry them at the end)


class FakeLLMEngine:
    """``llm.llm_engine`` as the request loop uses it: ``add_request`` / ``step`` (one token per
    running request per step, as DELTA outputs) / ``abort_request``. ``step()`` while paused with
    nothing queued fails (vLLM's would block for ever). ``on_step(n)`` runs inside step ``n``;
    ``fail_at``: the step that raises."""

    def __init__(self, llm: "FakeLLM"):
        self.llm = llm
        core = type(llm.client, (), {"shutdown": lambda self: None})()
        if llm.client == "InprocClient":
            core.engine_core = SimpleNamespace(batch_queue=None)
        else:
            core.outputs_queue = queue.Queue()  # what the engine process sent, not collected yet
        self.engine_core = core
        self.requests: dict[str, FakeRequest] = {}
        self.added: list[tuple[str, list[int], int, str]] = []  # (id, prompt, seed, cache salt)
        self.aborted: list[str] = []
        self.steps = 0
        self.on_step: Callable[[int], None] | None = None
        self.fail_at: int | None = None

    def add_request(self, request_id, prompt, params):
        with self.llm.inside("add_request"):
            assert prompt["type"] == "token" and params.output_kind in ("DELTA", "FINAL_ONLY")
            assert request_id not in self.requests
            self.requests[request_id] = FakeRequest(prompt["prompt_token_ids"], params, self.llm.weights)
            self.llm.claim(request_id, prompt["prompt_token_ids"], params)
            self.added.append((request_id, prompt["prompt_token_ids"], params.seed, prompt.get("cache_salt")))
            return request_id + "-internal"

    def abort_request(self, request_ids, internal=False):
        with self.llm.inside("abort_request"):
            for rid in request_ids:
                self.requests.pop(rid, None)
                self.llm.slots.pop(rid, None)
                self.aborted.append(rid)

    def has_unfinished_requests(self):
        with self.llm.inside("has_unfinished_requests"):
            return bool(self.requests)

    def step(self):
        with self.llm.inside("step"):
            q = getattr(self.engine_core, "outputs_queue", None)
            if q is not None and not q.empty():
                return q.get_nowait()
            assert not self.llm.paused, "step() while paused with nothing queued: vLLM's would wait for ever"
            self.steps += 1
            if self.steps == self.fail_at:
                raise RuntimeError("boom: the engine process died")
            outputs = self.produce()
            if self.on_step is not None:
                self.on_step(self.steps)
            return outputs

    def produce(self) -> list:
        """One token for every running request (the weights loaded now sample it): an output per
        request (DELTA: the new token), or at its end only (FINAL_ONLY: every token)."""
        outputs = []
        for rid, r in list(self.requests.items()):
            token = fake_token(r.prompt, self.llm.weights, r.kv, r.produced)
            self.llm.record(rid, len(r.prompt) + r.produced, -token / 1e6)
            r.produced += 1
            r.tokens.append(token)
            done = r.produced == r.params.max_tokens
            if r.params.output_kind == "FINAL_ONLY" and not done:
                continue
            tokens = [token] if r.params.output_kind == "DELTA" else list(r.tokens)
            n = len(tokens)
            flat = SimpleNamespace(start_indices=list(range(n)), end_indices=list(range(1, n + 1)), token_ids=tokens,
                                   logprobs=[-t / 1e6 for t in tokens])
            outputs.append(SimpleNamespace(request_id=rid, finished=done, outputs=[SimpleNamespace(
                token_ids=tokens, logprobs=None if r.params.logprobs is None else flat,
                finish_reason="length" if done else None)]))
            if done:
                del self.requests[rid]
                self.llm.slots.pop(rid, None)
        return outputs


class FakeLLM:
    """``vllm.LLM`` as the engine uses it; the worker runs the real extension. ``violations``
    lists every moment two threads were inside it at once, or weights loaded while it generated."""

    last: "FakeLLM" = None

    def __init__(self, **kwargs):
        from transformers import AutoModelForCausalLM

        from xrlhf.engines.vllm.extension import XrlhfWorkerExtension

        # as vLLM decides it: its engine core in this process where multiprocessing is off
        self.client = "InprocClient" if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" else "SyncMPClient"
        self.kwargs = kwargs
        self.calls: list = []
        model = fused_like_vllm(AutoModelForCausalLM.from_pretrained(kwargs["model"]))
        worker_cls = type("Worker", (XrlhfWorkerExtension,), {"_xrlhf_tp_rank": lambda self: 0})
        self.worker = worker_cls()
        self.worker.device = torch.device("cpu")
        self.worker.model_runner = SimpleNamespace(get_model=lambda: model, sampler=FakeSampler(), max_num_reqs=32,
                                                   speculator=None)
        self.slots: dict[str, int] = {}  # request id -> the worker's slot, reused as vLLM reuses them
        self._one = threading.Lock()
        self.violations: list[str] = []
        self.paused = False
        self.generated = 0
        self.weights = 0  # syncs finished
        self.llm_engine = FakeLLMEngine(self)
        FakeLLM.last = self

    def claim(self, request_id: str, prompt: list[int], params) -> None:
        """A request enters the worker: the sampler's ``add_request`` in the first free slot, under
        the id vLLM's worker sees (the given one, ``-`` and 8 characters)."""
        sampler = self.worker.model_runner.sampler
        if getattr(sampler, "_xrlhf_record", None) is None:
            return  # not recording: the fake keeps no slots
        slot = min(set(range(self.worker.model_runner.max_num_reqs)) - set(self.slots.values()))
        self.slots[request_id] = slot
        sampler.req_states.index_to_req_id[slot] = f"{request_id}-{slot:08d}"
        sampler.add_request(slot, len(prompt), params)

    def record(self, request_id: str, position: int, logprob: float) -> None:
        """The sampler recorded the token at ``position`` (``record.py``), when it records."""
        rec = getattr(self.worker.model_runner.sampler, "_xrlhf_record", None)
        if rec is not None:
            rec.write(torch.tensor([logprob]), torch.tensor([self.slots[request_id]]), torch.tensor([position]))

    @contextmanager
    def inside(self, name: str):
        """The thread-safety check: SyncMPClient is not thread-safe."""
        if not self._one.acquire(blocking=False):
            self.violations.append(f"{name} in {threading.current_thread().name} while another thread was inside")
            yield
            return
        try:
            yield
        finally:
            self._one.release()

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        with self.inside(method):
            self.calls.append(("rpc", method))
            if method == "xrlhf_receive" and self.llm_engine.requests and not self.paused:
                self.violations.append("weights loaded while requests were generating")
            if self.client != "InprocClient":
                args = pickle.loads(pickle.dumps(args))  # the process boundary
            result = [getattr(self.worker, method)(*args, **(kwargs or {}))]
            if method == "xrlhf_end_sync":
                self.weights += 1
            return result

    def sleep(self, level=1, mode="abort"):
        with self.inside("sleep"):
            self.calls.append(("sleep", level) if level else ("sleep", level, mode))
            if level == 0:
                self.paused = True
                q = getattr(self.llm_engine.engine_core, "outputs_queue", None)
                if mode == "keep" and q is not None and self.llm_engine.requests:
                    q.put(self.llm_engine.produce())  # the engine process ran one step ahead of the client

    def wake_up(self, tags=None):
        with self.inside("wake_up"):
            self.calls.append(("wake_up", tags))
            if tags == ["scheduling"]:
                self.paused = False

    def reset_prefix_cache(self, reset_running_requests=False):
        with self.inside("reset_prefix_cache"):
            self.calls.append(("reset_prefix_cache", True) if reset_running_requests else ("reset_prefix_cache",))
            if reset_running_requests:  # running requests recompute their KV with the weights loaded now
                for r in self.llm_engine.requests.values():
                    r.kv = self.weights

    def generate(self, prompts, sp, use_tqdm=True):
        with self.inside("generate"):
            assert not self.llm_engine.requests, "LLM.generate while the request loop had requests in vLLM"
            return self._generate(prompts, sp)

    def _generate(self, prompts, sp):
        self.calls.append(("generate", len(prompts)))
        out = []
        for i, p in enumerate(prompts):
            params = sp[i] if isinstance(sp, list) else sp
            ids = [(p["prompt_token_ids"][-1] + k) % 100 for k in range(1, 4)]
            assert params.flat_logprobs
            lps = SimpleNamespace(start_indices=[0, 1, 2], end_indices=[1, 2, 3], token_ids=ids,  # FlatLogprobs
                                  logprobs=[-0.5 * (k + 1) for k in range(3)])
            rid = str(self.generated)  # LLM.generate's ids: a counter
            self.generated += 1
            self.claim(rid, p["prompt_token_ids"], params)
            for k, lp in enumerate(lps.logprobs):
                self.record(rid, len(p["prompt_token_ids"]) + k, lp)
            self.slots.pop(rid, None)
            out.append(SimpleNamespace(request_id=rid, outputs=[SimpleNamespace(
                token_ids=ids, logprobs=None if params.logprobs is None else lps)]))
        return out


@pytest.fixture(scope="module")
def vllm_module():
    """``xrlhf.engines.vllm`` imported against the fake (once: it registers its engine)."""
    if REAL_VLLM:
        pytest.skip("the real vLLM is installed: tests/gpu covers the engine")
    fake = types.ModuleType("vllm")
    fake.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    fake.__version__ = "0.33.0"  # the hooks of xrlhf.internals.vllm run against the stand-in as against 0.33
    fake.LLM, fake.SamplingParams, fake.TokensPrompt = FakeLLM, FakeSamplingParams, dict
    parallel_state = types.ModuleType("vllm.distributed.parallel_state")
    parallel_state.get_tensor_model_parallel_world_size = lambda: 1
    inputs = types.ModuleType("vllm.inputs")
    inputs.tokens_input = lambda ids, *, prompt=None, cache_salt=None: {"type": "token", "prompt_token_ids": ids,
                                                                         "cache_salt": cache_salt}
    sampling = types.ModuleType("vllm.sampling_params")
    sampling.RequestOutputKind = SimpleNamespace(CUMULATIVE="CUMULATIVE", DELTA="DELTA", FINAL_ONLY="FINAL_ONLY")
    sampler = types.ModuleType("vllm.v1.worker.gpu.sample.sampler")
    sampler.Sampler = FakeSampler
    registry = types.ModuleType("vllm.model_executor.models.registry")

    def in_a_subprocess(fn):  # vLLM's: a new Python process runs ``fn`` (the engine replaces it)
        raise AssertionError("vLLM's model inspection ran in a subprocess")

    registry._run_in_subprocess = in_a_subprocess
    models = types.ModuleType("vllm.model_executor.models")
    models.registry = registry
    core_client = types.ModuleType("vllm.v1.engine.core_client")  # what the hooks' probes look for
    core_client.InprocClient = core_client.SyncMPClient = type("Client", (), {"shutdown": lambda self: None})
    logprob = types.ModuleType("vllm.v1.worker.gpu.sample.logprob")
    logprob.compute_token_logprobs = lambda logits, ids: torch.log_softmax(logits.float(), -1).gather(-1, ids.long())
    worker_manager = types.ModuleType("vllm.lora.worker_manager")
    worker_manager.WorkerLoRAManager = type("WorkerLoRAManager", (), {})
    fakes = {"vllm": fake, "vllm.distributed": types.ModuleType("vllm.distributed"),
             "vllm.distributed.parallel_state": parallel_state, "vllm.inputs": inputs, "vllm.sampling_params": sampling,
             **{m: types.ModuleType(m) for m in ("vllm.v1", "vllm.v1.worker", "vllm.v1.worker.gpu",
                                                 "vllm.v1.worker.gpu.sample")},
             "vllm.v1.worker.gpu.sample.sampler": sampler, "vllm.model_executor": types.ModuleType("vllm.model_executor"),
             "vllm.model_executor.models": models, "vllm.model_executor.models.registry": registry,
             "vllm.v1.engine": types.ModuleType("vllm.v1.engine"), "vllm.v1.engine.core_client": core_client,
             "vllm.v1.worker.gpu.sample.logprob": logprob, "vllm.lora": types.ModuleType("vllm.lora"),
             "vllm.lora.worker_manager": worker_manager}
    saved = {k: sys.modules.get(k) for k in fakes}
    sys.modules.update(fakes)
    internals.forget()
    import xrlhf.engines.vllm as module

    yield module
    for k, v in saved.items():
        if v is None:
            sys.modules.pop(k, None)
        else:
            sys.modules[k] = v
    internals.forget()


def engine_spec(model: str, **options) -> EngineSpec:
    """An engine of the options given; logprobs through vLLM's outputs unless said (the tests of
    the worker path, the default, name it: test_vllm_record.py and below)."""
    from xrlhf.engines.vllm import VLLMOptions  # the backend's file imports vLLM only to build an engine

    return EngineSpec(model, options=VLLMOptions(engine="vllm", **{"logprobs_path": "outputs", "multiprocessing": True,
                                                                   **options}), seed=3)


def test_llm_arguments_from_the_config(vllm_module, tiny_model):
    kwargs, env = vllm_module.llm_kwargs(engine_spec(
        tiny_model, gpu_memory_utilization=0.3, enforce_eager=True, sleep_level=2, max_model_len=512,
        engine_options={"max_num_seqs": 64, "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": 0}}))
    assert env == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert kwargs["model"] == tiny_model and kwargs["skip_tokenizer_init"] and kwargs["seed"] == 3
    assert kwargs["gpu_memory_utilization"] == 0.3 and kwargs["enforce_eager"] and kwargs["max_model_len"] == 512
    assert kwargs["enable_sleep_mode"] and kwargs["max_num_seqs"] == 64 and kwargs["tensor_parallel_size"] == 1
    assert kwargs["logprobs_mode"] == "processed_logprobs" and kwargs["generation_config"] == "vllm"
    assert kwargs["worker_extension_cls"] == "xrlhf.engines.vllm.extension.XrlhfWorkerExtension"
    assert "distributed_executor_backend" not in kwargs
    kwargs, _ = vllm_module.llm_kwargs(engine_spec(tiny_model, tensor_parallel_size=2, sleep_level=0))
    assert kwargs["distributed_executor_backend"] == "mp" and not kwargs["enable_sleep_mode"]


def test_sampling_parameters_and_outputs(vllm_module, tiny_model):
    engine = vllm_module.VLLMGenerateEngine(engine_spec(tiny_model))
    assert engine.eos_ids == [2] and not engine.model_in_process
    sp = engine.sampling_params(SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=5), 2)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.max_tokens, sp.stop_token_ids, sp.logprobs, sp.detokenize,
            sp.flat_logprobs) == (0.7, 0.9, 0, 5, [2], 0, False, True)
    sp = engine.sampling_params(SamplingParams(ignore_eos=True, stop_token_ids=[7]), 2)
    assert sp.ignore_eos and sp.stop_token_ids == []  # as the HF engine: nothing stops it
    seeded = engine.sampling_params(SamplingParams(seed=10, stop_token_ids=[7]), 3)
    assert [s.seed for s in seeded] == [10, 11, 12] and seeded[0].stop_token_ids == [7]
    out = engine.generate([[1, 5], [1, 6]], SamplingParams())
    assert out.token_ids == [[6, 7, 8], [7, 8, 9]] and out.logprobs[0] == [-0.5, -1.0, -1.5]
    flat = SimpleNamespace(start_indices=[0, 1], token_ids=[6, 9], logprobs=[-0.5, -1.0])
    assert vllm_module.sampled_logprobs(flat, [6, 9]) == [-0.5, -1.0]
    with pytest.raises(RuntimeError, match="do not match"):
        vllm_module.sampled_logprobs(flat, [6, 8])


def trained_weights(tiny_model) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return list(model.state_dict().items())


@pytest.mark.parametrize("client", ["SyncMPClient", "InprocClient"])
def test_sync_while_asleep_loads_in_the_worker_and_reads_back_by_hf_name(vllm_module, tiny_model, client):
    engine = vllm_module.VLLMGenerateEngine(engine_spec(tiny_model, sleep_level=2,
                                                        multiprocessing=client == "SyncMPClient"))
    llm = FakeLLM.last
    assert engine.model_in_process == (client == "InprocClient")
    weights = trained_weights(tiny_model)
    want = {n: checksum(t) for n, t in weights}
    with pytest.raises(WeightSyncError, match="without verify"):  # no verified sync yet: nothing to read back
        compare_checksums(want, engine.weight_checksums())
    engine.sleep()
    with pytest.raises(WeightSyncError, match="level 2"):
        engine.generate([[1]], SamplingParams())
    llm.calls.clear()
    transport = build_transport("in_process" if client == "InprocClient" else "cpu", bucket_bytes=20_000,
                                verify=True)
    n = push_weights(transport, weights, engine.receive_weights)
    engine.end_sync()
    assert n == len(weights)
    rpcs = [c for c in llm.calls if c[0] == "rpc"]
    assert llm.calls[0] == ("wake_up", ["weights"]) and llm.calls[-1] == ("wake_up", ["kv_cache"])
    assert len(rpcs) > 2 and all(c == ("rpc", "xrlhf_receive") for c in rpcs[:-1]) and rpcs[-1][1] == "xrlhf_end_sync"
    got = engine.weight_checksums()
    compare_checksums(want, got)  # by HF name whatever vLLM fused (q/k/v, gate/up); tied lm_head included
    assert "model.layers.0.self_attn.k_proj.weight" in got and "lm_head.weight" in got
    engine.generate([[1]], SamplingParams())
    assert ("reset_prefix_cache",) in llm.calls


def test_a_corrupted_bucket_stops_the_sync_in_the_worker(vllm_module, tiny_model):
    engine = vllm_module.VLLMGenerateEngine(engine_spec(tiny_model))
    transport = build_transport("cpu", verify=True)
    message = next(transport.send(trained_weights(tiny_model)))
    message.payload[message.meta["offsets"][3] + 5] ^= 4  # a byte of the fourth tensor in the flat buffer
    with pytest.raises(WeightSyncError, match=repr(message.names[3])):
        engine.receive_weights(transport, [message])


def test_an_incomplete_sync_fails_with_verify_on(vllm_module, tiny_model):
    engine = vllm_module.VLLMGenerateEngine(engine_spec(tiny_model))
    weights = [(n, t) for n, t in trained_weights(tiny_model) if "layers.1.mlp" not in n]
    push_weights(build_transport("cpu", verify=True), weights, engine.receive_weights)
    with pytest.raises(WeightSyncError, match=r"layers\.1\.mlp\.down_proj.*layers\.1\.mlp\.gate_up_proj"):
        engine.end_sync()
    push_weights(build_transport("cpu", verify=False), weights, engine.receive_weights)
    engine.end_sync()  # verify off: not checked


def test_a_worker_builds_the_transport_it_is_given(vllm_module, tiny_model):
    """``auto`` is resolved once, by the shell (``weight_sync.choose_transport``: tests/config/
    test_layouts.py); a worker builds the transport it is told, with the dtype by name."""
    from xrlhf.coordinator.worker import EngineWorker

    worker = EngineWorker("rollout", 0)
    worker.gen = vllm_module.VLLMGenerateEngine(engine_spec(tiny_model))
    assert worker.set_transport({"verify": True, "dtype": "bfloat16"}, "cpu") == "cpu"
    assert worker.transport.dtype == torch.bfloat16 and worker.transport.verify
    assert worker.set_transport({}, "cuda_ipc") == "cuda_ipc" and worker.transport.name == "cuda_ipc"


def test_large_buffers_cross_to_vllm_through_shared_memory(tmp_path):
    """The cpu transport's buckets reach vLLM's engine process through shared-memory files, not the
    RPC: the RPC carries metadata only, msgpack's lists-for-tuples are accepted, the files are
    reused by the next sync and removed with the pool (and a dead process's by the next pool);
    without shared memory everything goes in band."""
    import os

    from xrlhf.engines.vllm.extension import ShmPool, from_payload, to_payload

    pool = ShmPool(str(tmp_path))
    transport = build_transport("cpu", verify=True)  # sent as is (not ``local``): its numpy buffer out of band
    weights = [("big", torch.randn(1024, 1024)), ("small", torch.randn(8))]
    for step in range(2):
        weights[0][1].add_(1.0)
        messages = list(transport.send(weights))
        payload = to_payload((transport, messages), pool)
        (path, nbytes), = payload[1]
        assert os.path.exists(path) and nbytes >= 4 << 20 and len(payload[0]) < 64 << 10
        assert path == pool.slots[0][0]  # the same file every sync
        got_transport, got_messages = from_payload([payload[0], [list(f) for f in payload[1]]])  # as msgpack gives it
        received = dict(got_transport.receive(got_messages[0]))  # checksums verified on the mapped bytes
        assert all(torch.equal(received[n], t) for n, t in weights)
    pool.close()
    assert not os.path.exists(path)

    stale = tmp_path / "xrlhf-999999999-0"  # no such process
    stale.write_bytes(b"x")
    ShmPool(str(tmp_path)).close()
    assert not stale.exists()

    inband = to_payload((transport, messages), ShmPool(str(tmp_path / "missing")))
    assert inband[1] == [] and len(inband[0]) > 4 << 20
    got_transport, got_messages = from_payload(inband)
    assert dict(got_transport.receive(got_messages[0]))["big"].equal(weights[0][1])


def test_cpu_transport_names_its_shared_buffer_to_a_receiver_on_this_host(tmp_path, monkeypatch):
    """The cpu transport's host buffers are shared-memory files: ``local`` sends a message without
    its bytes, the receiver maps the file, checksums hold; without room for the files, the
    buffers are plain memory and ``local`` keeps the bytes."""
    import os

    from xrlhf.weight_sync import memory

    monkeypatch.setattr(memory.SharedFiles.__init__, "__defaults__", (str(tmp_path),))
    transport = build_transport("cpu", verify=True)
    weights = [("a", torch.randn(300, 300)), ("b", torch.arange(10))]
    (message,) = list(transport.send(weights))
    assert os.path.dirname(message.meta["shm"]) == str(tmp_path)
    light = transport.local(message)
    assert light.payload is None and len(pickle.dumps(light)) < 4096
    peer = pickle.loads(pickle.dumps(transport))  # the receiver's copy, in another process
    received = dict(peer.receive(pickle.loads(pickle.dumps(light))))
    assert all(torch.equal(received[n], t) for n, t in weights)
    transport._host.shared.close()
    assert not os.listdir(tmp_path)

    monkeypatch.setattr(memory.SharedFiles.__init__, "__defaults__", (str(tmp_path / "missing"),))
    plain = build_transport("cpu", verify=True)
    (message,) = list(plain.send(weights))
    assert "shm" not in message.meta and plain.local(message) is message
