"""vLLM backend of the generate engine (vLLM 0.33; 0.25 too), imported only when ``engine: vllm``.

One ``vllm.LLM`` per engine, fed token ids (the model's EOS passed as a stop id). Its parts, each
described in docs/vllm.md:

* logprobs: asked as ``processed_logprobs`` (after temperature and top-k/top-p), the contract of
  ``GenerateEngine`` under the RL default ``top_p: 1, top_k: 0``; with ``logprobs_path: worker``
  kept on the GPU in vLLM's worker and taken once per call (``internals/vllm_record.py``);
* weights: received inside vLLM's worker (``extension.XrlhfWorkerExtension``, through
  ``collective_rpc``), so IPC handles are mapped and checksums checked where the weights land;
  a LoRA adapter synced as such is loaded with the worker's ``add_lora`` (docs/lora.md);
* threads: keyed calls (``seeds``) go through ``loop``'s request loop, which a weight sync pauses
  mid-generation; one thread touches ``self.llm`` at a time;
* memory: with ``sleep_level`` 1 or 2, ``sleep()`` frees the KV cache (and the weights); a sync
  while asleep wakes the weights only, and the KV cache wakes after the trainer returned its memory.
"""

from __future__ import annotations

import gc
import logging
import os
from contextlib import contextmanager
from typing import Any, Iterator

from pydantic import BaseModel

from xrlhf.engines.base import (ENGINES, EngineSpec, GenerateEngine, GenerationOutput, NamedTensors, RolloutPlan,
                                SamplingParams)
from xrlhf.engines.vllm.extension import LORA_ID, LORA_NAME, ShmPool, to_payload
from xrlhf.engines.vllm.loop import RequestLoop, sampled_logprobs
from xrlhf.engines.vllm.options import ENV_DEFAULTS, LORA_RANKS, VLLMOptions, engine_env, llm_kwargs
from xrlhf.internals.vllm import inspect_models_in_process, shutdown
from xrlhf.internals.vllm_record import WORKER_LOGPROBS
from xrlhf.weight_sync import Message, Transport, WeightSyncError, build_transport

@ENGINES.register("vllm.generate")
class VLLMGenerateEngine(GenerateEngine):
    """Generation with ``vllm.LLM``; weights in through the worker extension. Options: ``VLLMOptions``."""

    Options = VLLMOptions
    requires = ("vllm",)
    supported = {"vllm": ("0.25", "0.33")}  # docs/vllm.md: the version matrix
    pip_extra = "gpu"
    starts_alone = True  # vLLM sizes its KV cache from the GPU memory it sees free while it starts (by default)
    pauses_mid_generation = True  # keyed calls: the request loop pauses, loads, resumes
    batches_concurrent_calls = True  # keyed calls: one request loop serves them all
    memory_model = "paged"  # Engine.memory_model: its KV cache is a share of the GPU or kv_cache_tokens
    sleep_levels = (2, 1, 0)  # VLLMOptions.sleep_level: 2 drops the weights, 1 keeps them in CPU memory
    tensor_parallel = True

    @classmethod
    def workers_per_engine(cls, options: BaseModel) -> int:
        return options.tensor_parallel_size

    @classmethod
    def starts_alone_with(cls, options: BaseModel | dict[str, Any]) -> bool:
        """Alone unless ``kv_cache_tokens`` sizes the KV cache: vLLM then measures no free memory
        (``determine_available_memory`` returns the given size after its profile run,
        v1/worker/gpu_worker.py:442-460), so others may allocate while it starts."""
        return _options(options).kv_cache_tokens is None

    @classmethod
    def preload(cls, options: BaseModel | dict[str, Any]) -> None:
        """Set the engine's environment and import vLLM (what ``__init__`` does first), e.g. in a
        thread while the trainer's engines build; a later ``__init__`` finds it imported."""
        set_environment(_options(options))
        # The heap so far (torch's modules) is there for good: frozen, the collections that vLLM's
        # ~2,000 modules trigger while they load do not walk it again (see also ``__init__``).
        gc.freeze()
        import vllm  # noqa: F401
        from vllm import LLM  # noqa: F401 - the lazy attribute imports the engine's modules

        inspect_models_in_process()

    @classmethod
    def placement_errors(cls, options: BaseModel, where: str, gpus_per_rank: float, split: bool) -> list[str]:
        tp, errors = options.tensor_parallel_size, []
        if tp > 1 and not split:
            errors.append("policy.generate.tensor_parallel_size: more than 1 needs the split layout "
                          "(policy.generate.resources with gpus_per_rank >= tensor_parallel_size)")
        if gpus_per_rank == 0 or tp > 1 and gpus_per_rank < tp:
            errors.append(f"{where}.gpus_per_rank: engine vllm needs {tp} GPU(s) per generator, got {gpus_per_rank:g}")
        return errors

    @classmethod
    def adapter_errors(cls, options: BaseModel, adapter: BaseModel) -> list[str]:
        """vLLM serves the policy's LoRA adapter from tensors (``extension``): up to rank 512, and
        only while it keeps the base weights (an adapter sync does not send them again)."""
        errors = []
        if adapter.rank > LORA_RANKS[-1]:
            errors.append(f"policy.train.lora.rank: vLLM serves LoRA adapters up to rank {LORA_RANKS[-1]}, got "
                          f"{adapter.rank}; lower it or set policy.train.lora.sync: merged")
        if options.sleep_level == 2:
            errors.append("policy.generate.sleep_level: 2 drops vLLM's weights while training, and an adapter sync "
                          "(policy.train.lora.sync: adapter) sends only the adapter, never the base again; set "
                          "sleep_level: 1 (weights to CPU memory) or 0, or sync: merged")
        return errors

    @classmethod
    def rollout_errors(cls, options: BaseModel, rollout: BaseModel, plan: RolloutPlan) -> list[str]:
        """Asynchronous and co-located, vLLM stays awake beside the trainer: no sleep, and its
        ``gpu_memory_utilization`` share plus the trainer's estimated peak must fit the GPU."""
        errors = super().rollout_errors(options, rollout, plan)
        if plan.split or rollout.max_staleness == 0:
            return errors
        if options.sleep_level > 0:
            errors.append(f"policy.generate.sleep_level: with rollout.max_staleness {rollout.max_staleness} the "
                          f"co-located vLLM generates while the trainer trains, so it cannot sleep; set sleep_level: 0 "
                          f"(and leave the trainer room: gpu_memory_utilization), or use the split layout "
                          f"(policy.generate.resources)")
        if plan.device_gib and plan.trainer_gib:
            vllm_gib = options.gpu_memory_utilization * plan.device_gib
            if vllm_gib + plan.trainer_gib > 0.95 * plan.device_gib:
                fits = max(0.0, (0.95 * plan.device_gib - plan.trainer_gib) / plan.device_gib)
                errors.append(
                    f"policy.generate.gpu_memory_utilization: vLLM stays awake with rollout.max_staleness "
                    f"{rollout.max_staleness}: {options.gpu_memory_utilization:g} x {plan.device_gib:.1f} GiB = "
                    f"{vllm_gib:.1f} GiB, plus the trainer's ~{plan.trainer_gib:.1f} GiB (estimated: weights, gradients, "
                    f"Adam states, activations, a reference on the GPU) is over 95% of the GPU; set it to "
                    f"{fits:.2f} or less, lower policy.train.micro_batch_size, use the split layout "
                    f"(policy.generate.resources), or set rollout.max_staleness: 0")
        return errors

    def __init__(self, spec: EngineSpec):
        super().__init__(spec)
        kwargs, _ = llm_kwargs(self.spec)
        if kwargs.get("stream_interval", 1) != 1:  # held-back tokens would be stamped with a later version
            raise ValueError("policy.generate.engine_options.stream_interval: xrlhf needs every step's tokens "
                             f"(1), got {kwargs['stream_interval']}")
        set_environment(self.options)
        from vllm import LLM

        inspect_models_in_process()
        self.sleep_level = self.options.sleep_level
        self.frees_memory_when_asleep = self.sleep_level > 0
        # vLLM collects the whole heap about twelve times while it starts (memory snapshots, its
        # profile run, before graph capture, its own freeze at the end), each over a heap of torch's,
        # transformers' and vLLM's modules (seconds of a warm start: docs/architecture.md).
        # Collected once and frozen first (what vLLM does once started, freeze_gc_heap), those
        # collections see only what the engine allocates; ``shutdown`` unfreezes, as vLLM's does.
        gc.collect()
        gc.freeze()
        quiet_chat_template_warmup()
        self.llm = LLM(**kwargs)
        # vLLM's engine core runs in this process unless its multiprocessing is on (read by vLLM at start)
        self.model_in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"
        self.eos_ids = _eos_ids(spec.model_path)
        self._asleep: set[str] = set()
        self._weights_valid = True  # False after a level-2 sleep until weights are loaded again
        self._verify = False
        self._reset_cache = False
        self._shm: ShmPool | None = None  # buffers for vLLM's engine process (cpu transport)
        self._lora = None  # the LoRARequest of the policy's adapter, once a sync has installed one
        self._adapter_sent = False
        self._adapter_dir: str | None = None
        if spec.adapter is not None:  # syncs carry a LoRA adapter, which the workers write here for vLLM's loader
            import tempfile

            a = spec.adapter
            self._adapter_dir = tempfile.mkdtemp(prefix="xrlhf-lora-", dir="/dev/shm" if os.path.isdir("/dev/shm")
                                                 else None)
            self._rpc("xrlhf_set_adapter", {"r": a.rank, "lora_alpha": a.lora_alpha, "target_modules": a.target_modules,
                                            "bias": "none"}, self._adapter_dir)
        self._loop = RequestLoop(self.llm, version=lambda: self.version, prepare=self._prepare_requests,
                                 lora=lambda: self._lora, take=self._take_logprobs)
        self.logprobs_path = self.options.logprobs_path
        if self.logprobs_path == "worker" and not WORKER_LOGPROBS.active():
            self.logprobs_path = "outputs"  # the hook's public fallback (it said so)
        if self.logprobs_path == "worker":  # logprobs kept on the GPU in vLLM's worker (internals/vllm_record.py)
            self._rpc("xrlhf_record_logprobs")
        self._sync: bool | None = None  # during a sync (its thread only): whether it paused generation

    # -- generation ---------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 seeds: list[int] | None = None) -> GenerationOutput:
        """``seeds`` given: through the request loop (``loop``), which serves concurrent calls
        together and lets a weight sync land mid-generation; each token is stamped with the
        version that sampled it. ``None``: ``LLM.generate``, once the loop is idle."""
        if seeds is None:
            with self._loop.exclusive():
                return self._generate_batch(prompts, params)
        if len(seeds) != len(prompts):
            raise ValueError(f"generate: {len(seeds)} seeds for {len(prompts)} prompts")
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        # Per-step (DELTA) outputs only when weights may land mid-call: they tell which weights
        # sampled each token, but cost host time on every step (generation measured slower than with
        # LLM.generate's final-only outputs: docs/vllm.md). Final-only rows see no update:
        # one that lands anyway restarts them ("abort"), so their stamps stay right.
        kind = RequestOutputKind.DELTA if params.in_flight else RequestOutputKind.FINAL_ONLY
        fields = dict(self._sampling_fields(params), output_kind=kind)
        seeded = self.options.seeded_sampling
        call = self._loop.generate(prompts, seeds, lambda seed: VSamplingParams(**fields, seed=seed if seeded else None),
                                   params.on_update if params.in_flight else "abort", self._logprobs_from(params))
        return GenerationOutput([r.token_ids for r in call.rows],
                                [r.logprobs for r in call.rows] if params.logprobs else [],
                                [r.versions for r in call.rows])

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams) -> GenerationOutput:
        from vllm import TokensPrompt

        self._check_weights()
        self._wake({"weights", "kv_cache"})
        if self._reset_cache:  # cached prefixes were computed with the old weights
            self.llm.reset_prefix_cache()
            self._reset_cache = False
        sp = self.sampling_params(params, len(prompts))
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts], sp,
                                 use_tqdm=False, **({} if self._lora is None else {"lora_request": self._lora}))
        token_ids = [list(out.outputs[0].token_ids) for out in outs]
        source = self._logprobs_from(params)
        if source == "worker":
            logprobs = self._take_logprobs([out.request_id for out in outs], token_ids, [])
        else:
            logprobs = [sampled_logprobs(out.outputs[0].logprobs, ids) for out, ids in zip(outs, token_ids)] \
                if source == "outputs" else []
        return GenerationOutput(token_ids, logprobs, [[self.version] * len(ids) for ids in token_ids])

    def _logprobs_from(self, params: SamplingParams) -> str | None:
        """Where a call's logprobs come from: vLLM's ``"outputs"``, its ``"worker"``, or nowhere."""
        return self.logprobs_path if params.logprobs else None

    def _take_logprobs(self, ids: list[str], token_ids: list[list[int]], drop: list[str]) -> list[list[float]]:
        """The worker-side logprobs of finished requests ``ids`` (``xrlhf_take_logprobs``), one list
        per request as long as its tokens; ``drop``: requests whose logprobs are never taken."""
        import numpy as np

        lengths = [len(t) for t in token_ids]
        flat = np.frombuffer(self._rpc("xrlhf_take_logprobs", list(ids), lengths, list(drop))[0], dtype=np.float32)
        ends = np.cumsum(lengths).tolist()
        return [flat[end - n:end].tolist() for n, end in zip(lengths, ends)]

    def _prepare_requests(self, idle: bool) -> None:
        """Run by the request loop, owning the LLM, before it adds a call's requests. The prefix
        cache of old weights is reset when nothing runs; while requests hold it, the cache salt,
        which changes with every sync, keeps new requests off it."""
        self._check_weights()
        self._wake({"weights", "kv_cache"})
        if self._reset_cache and idle:
            self.llm.reset_prefix_cache()
            self._reset_cache = False

    def _check_weights(self) -> None:
        if not self._weights_valid or (self.sleep_level == 2 and "weights" in self._asleep):
            raise WeightSyncError("vLLM slept at level 2 and dropped its weights; sync weights before generating "
                                  "(or use policy.generate.sleep_level: 1)")

    def sampling_params(self, params: SamplingParams, n: int, seeds: list[int] | None = None):
        """``vllm.SamplingParams`` for our ``params`` (a list, one per prompt, when seeded:
        ``seeds``, else ``params.seed + i``)."""
        from vllm import SamplingParams as VSamplingParams

        base = self._sampling_fields(params)
        if seeds is not None:
            return [VSamplingParams(**base, seed=int(s)) for s in seeds]
        if params.seed is None:
            return VSamplingParams(**base)
        return [VSamplingParams(**base, seed=params.seed + i) for i in range(n)]

    def _sampling_fields(self, params: SamplingParams) -> dict[str, Any]:
        stop = [] if params.ignore_eos else list(params.stop_token_ids or self.eos_ids)
        return dict(n=1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or 0,
                    max_tokens=params.max_new_tokens, stop_token_ids=stop, ignore_eos=params.ignore_eos,
                    logprobs=0 if self._logprobs_from(params) == "outputs" else None, flat_logprobs=True,
                    detokenize=False)

    # -- weights ------------------------------------------------------------------------------
    @contextmanager
    def _syncing(self) -> Iterator[None]:
        """Part of a sync: the first part takes the LLM (pausing running generation, see
        ``loop``); a failure ends the sync, failing the calls it paused."""
        if self._sync is None:
            self._sync = self._loop.begin_sync()
        try:
            yield
        except BaseException as e:
            paused, self._sync, self._verify = self._sync, None, False
            self._loop.finish_sync(paused, e)
            raise

    def receive_weights(self, transport: Transport, messages: list[Message] | None = None) -> int:
        """Run the transport's receive side in vLLM's workers and load what arrives there. The
        first call of a sync pauses any generation running (``pauses_mid_generation``)."""
        with self._syncing():
            self._wake({"weights"})
            self._verify = self._verify or transport.verify
            n = 0
            for part in [None] if messages is None else [[m] for m in messages]:  # one bucket per call
                if self.model_in_process:  # no process boundary: hand the objects over as they are
                    n += int(self._rpc("xrlhf_receive", (transport, part))[0])
                    continue
                if self._shm is None:
                    self._shm = ShmPool()
                local = None if part is None else [transport.local(m) for m in part]  # same host: name shared buffers
                n += int(self._rpc("xrlhf_receive", to_payload((transport, local), self._shm))[0])  # extension.py
            self._weights_valid = True
            self._reset_cache = True
            self._adapter_sent = self._adapter_sent or n > 0
            return n

    def connect_transport(self, transport: Transport) -> None:
        """Open a broadcast transport's group in vLLM's workers, where ``receive_weights`` uses it."""
        self._rpc("xrlhf_connect", transport if self.model_in_process else to_payload(transport, None))

    def update_weights(self, weights: NamedTensors) -> None:
        """Load ``(HF name, tensor)`` pairs: part of a sync, which ``end_sync`` ends."""
        weights = list(weights)
        if not self.model_in_process:
            transport = build_transport("cpu")
            self.receive_weights(transport, list(transport.send(weights)))
            return
        with self._syncing():
            self._wake({"weights"})
            self._rpc("xrlhf_load_weights", weights)
            self._weights_valid, self._reset_cache = True, True
            self._adapter_sent = self._adapter_sent or bool(weights)

    def end_sync(self, version: int | None = None) -> None:
        """After the last bucket: check every parameter was loaded (with verify on), set the
        version, wake; generation paused by the sync resumes (``on_update``)."""
        with self._syncing():
            if version is not None:
                self.version = version
            missing = sorted({n for per_worker in self._rpc("xrlhf_end_sync") for n in per_worker})
            verify, self._verify = self._verify, False
            if verify and missing:
                raise WeightSyncError(f"weight sync: {len(missing)} vLLM parameters were not loaded: "
                                      + ", ".join(missing[:8]))
            if self.spec.adapter is not None and self._lora is None and self._adapter_sent:  # the first one is in
                from vllm.lora.request import LoRARequest

                self._lora = LoRARequest(LORA_NAME, LORA_ID, lora_path=f"{self._adapter_dir}/tp0")
            self._wake({"weights", "kv_cache"})
        paused, self._sync = self._sync, None
        self._loop.finish_sync(bool(paused))

    def weight_checksums(self) -> dict[str, int]:
        with self._loop.exclusive():
            self._wake({"weights", "kv_cache"})
            return dict(self._rpc("xrlhf_weight_checksums")[0])

    def _rpc(self, method: str, *args) -> list:
        """``collective_rpc`` on every worker; a weight-sync failure there comes back as one here
        (vLLM's engine process returns errors as a plain ``Exception`` with the message)."""
        try:
            return self.llm.collective_rpc(method, args=args)
        except WeightSyncError:
            raise
        except Exception as e:
            if "weight sync" in str(e):
                raise WeightSyncError(str(e)) from e
            raise

    # -- memory -------------------------------------------------------------------------------
    def sleep(self) -> None:
        if self.sleep_level == 0 or self._asleep:
            return
        with self._loop.exclusive():  # LLM.sleep's default mode aborts requests: only when none run
            if self._asleep:
                return
            self.llm.sleep(level=self.sleep_level)
            self._asleep = {"weights", "kv_cache"}
            if self.sleep_level == 2:
                self._weights_valid = False

    def wake_up(self) -> None:
        if not self._asleep:  # awake: no need to wait for the LLM
            return
        with self._loop.exclusive():
            self._wake({"weights", "kv_cache"})

    def _wake(self, tags: set[str]) -> None:
        # weights first: the KV cache, the largest allocation, comes back last
        for tag in ("weights", "kv_cache"):
            if tag in tags and tag in self._asleep:
                self.llm.wake_up(tags=[tag])
                self._asleep.discard(tag)
                if tag == "weights" and self._lora is not None:  # the adapter is loaded again after a wake
                    self._rpc("xrlhf_reload_adapter")

    def shutdown(self) -> None:
        if getattr(self, "_loop", None) is not None:
            self._loop.stop()
        if getattr(self, "_adapter_dir", None):
            import shutil

            shutil.rmtree(self._adapter_dir, ignore_errors=True)
        if getattr(self, "_shm", None) is not None:
            self._shm.close()
        llm = getattr(self, "llm", None)
        if llm is not None:
            shutdown(llm)
            self.llm = None
            gc.unfreeze()  # the heap frozen before the engine started (``__init__``) is collectable again


def _options(options: BaseModel | dict[str, Any]) -> VLLMOptions:
    return options if isinstance(options, VLLMOptions) else VLLMOptions.model_validate(
        options.model_dump() if isinstance(options, BaseModel) else options)


def set_environment(options: VLLMOptions) -> None:
    """The engine's variables (``engine_env``) and ``ENV_DEFAULTS`` where unset, before vLLM is imported."""
    os.environ.update(engine_env(options))
    for k, v in ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)


def _eos_ids(model_path: str) -> list[int]:
    """The model's EOS ids from its ``generation_config.json`` or ``config.json`` (no tokenizer)."""
    import json
    from pathlib import Path

    for name in ("generation_config.json", "config.json"):
        f = Path(model_path) / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                return [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]
    return []


class _NoChatTemplateWarmup(logging.Filter):
    """Drops vLLM's "Chat template warmup failed" warning (``LLM.__init__`` renders a chat message
    to warm its template up, since vLLM 0.33): the engine starts without a tokenizer
    (``skip_tokenizer_init``: xrlhf sends token ids), so that warm-up always fails, harmlessly, and
    would print a traceback into every run's log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "Chat template warmup failed"


def quiet_chat_template_warmup() -> None:
    """Installs ``_NoChatTemplateWarmup`` on vLLM's renderer logger, once per process."""
    log = logging.getLogger("vllm.renderers.base")
    if not any(isinstance(f, _NoChatTemplateWarmup) for f in log.filters):
        log.addFilter(_NoChatTemplateWarmup())
