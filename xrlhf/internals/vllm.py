"""vLLM's internals: model inspection in-process, pausing mid-generation, the engine core's
shutdown, the LoRA layer check; the worker's logprob record is ``internals/vllm_record.py``.

The offline ``vllm.LLM`` has public sleep/wake-up (level 0 pauses scheduling with the requests
kept), ``collective_rpc`` and ``llm_engine.add_request/step/abort_request``. What it lacks, the
hooks below read from its engine core client (``InprocClient`` in-process, ``SyncMPClient`` with
a process of its own); each names its public fallback.
"""

from __future__ import annotations

from typing import Any

from xrlhf.internals import Hook, needs

CHECKED = ("0.25", "0.33")
"""vLLM releases the hooks of this module were checked on."""


INSPECT_IN_PROCESS = Hook(
    "vllm.inspect_in_process", "vllm", CHECKED,
    buys="vLLM inspects a model class in the generator's process instead of a new Python process that "
         "imports vLLM again (on a machine without vLLM's cache: every first start)",
    without="vLLM inspects each model class in a subprocess once per cache",
    probe=needs("vllm.model_executor.models.registry", "_run_in_subprocess"))


def inspect_models_in_process() -> None:
    """Let vLLM inspect a model class in this process (it has vLLM imported and initialises CUDA
    for vLLM anyway); the answer still goes to vLLM's cache."""
    if INSPECT_IN_PROCESS.active():
        from vllm.model_executor.models import registry

        registry._run_in_subprocess = lambda fn: fn()


_CORE_CLIENTS = needs("vllm.v1.engine.core_client", "InprocClient.shutdown", "SyncMPClient.shutdown")


PAUSE = Hook(
    "vllm.pause_mid_generation", "vllm", CHECKED,
    buys="a weight sync lands while keyed calls generate: vLLM pauses with its requests kept, loads, resumes "
         "(one step off: generation does not wait for the trainer's sync)",
    without="a sync waits until the running generation has finished",
    probe=_CORE_CLIENTS)


def can_pause(llm: Any) -> bool:
    """Whether the request loop may pause ``llm`` mid-generation and tell when its outputs are in
    (``outputs_pending``): the engine core client is one of the two it knows."""
    if not PAUSE.active():
        return False
    core = llm.llm_engine.engine_core
    return hasattr(core, "outputs_queue") or hasattr(core, "engine_core")


def outputs_pending(llm: Any) -> bool:
    """Whether ``llm`` holds outputs the client has not collected, so that ``step()`` returns at
    once: ``SyncMPClient``'s queue that its socket thread fills; ``InprocClient``'s batch queue."""
    core = llm.llm_engine.engine_core
    queue = getattr(core, "outputs_queue", None)
    if queue is not None:
        return not queue.empty()
    return bool(getattr(getattr(core, "engine_core", None), "batch_queue", None))


SHUTDOWN = Hook(
    "vllm.shutdown", "vllm", CHECKED,
    buys="an engine's GPU memory and processes are freed when xrlhf shuts it down (healing, tests)",
    without="the engine is dropped and collected; its memory is freed when nothing else holds it",
    probe=_CORE_CLIENTS)


def shutdown(llm: Any) -> None:
    """Shut ``llm``'s engine core down now (``vllm.LLM`` has no public call for it)."""
    if SHUTDOWN.active():
        llm.llm_engine.engine_core.shutdown()


LORA_CHECK = Hook(
    "vllm.lora_layer_check", "vllm", CHECKED,
    buys="a synced LoRA adapter with a layer vLLM has no LoRA slot for is refused (vLLM would ignore it "
         "silently and generate with the base weights there)",
    without="such a layer is not detected",
    probe=needs("vllm.lora.worker_manager", "WorkerLoRAManager"))


def unused_lora_layers(model_runner: Any, adapter_id: int) -> list[str]:
    """Layers of the loaded adapter ``adapter_id`` that match no LoRA layer of vLLM's model (read
    from the worker's adapter manager, which vLLM keeps private); empty where that cannot be read."""
    if not LORA_CHECK.active():
        return []
    try:
        inner = model_runner.lora_manager._adapter_manager
        lora = inner.get_adapter(adapter_id)
        return sorted(set(lora.loras) - set(inner.modules)) if lora is not None else []
    except AttributeError:
        return []
