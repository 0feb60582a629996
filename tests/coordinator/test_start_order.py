"""The order the coordinator builds engines in (``Coordinator.start``): every engine that does
not start alone is built side by side, the ``starts_alone`` ones (vLLM: its KV cache is sized
from the memory it sees free) after all of them, while nothing else is being built. Stamped
engines (``start_order_engines``) record when each was built; on the GPU the same order was run
with vLLM (docs/benchmarks.md, "sixth" session: 89 s against 102 s for the old order)."""

from __future__ import annotations

import pytest

from xrlhf.coordinator import Coordinator
from xrlhf.topology import topology
from xrlhf.validation import validate_dict

pytestmark = pytest.mark.usefixtures("ray_session")

MODULE = "tests.coordinator.start_order_engines"


def stamps(directory) -> dict[str, float]:
    return {p.name.rsplit("-", 1)[0]: float(p.read_text()) for p in directory.iterdir()}


def test_engines_that_start_alone_are_built_when_nothing_else_is(tiny_model, tmp_path):
    where = tmp_path / "stamps"
    cfg = validate_dict({
        "name": "order", "seed": 0, "ray": {"num_cpus": 2},
        "env": {"name": "reasoning", "options": {"eval_size": 8}},
        "policy": {"model": tiny_model, "train": {"lr": 1e-3, "micro_batch_size": 8},
                   "generate": {"engine": f"{MODULE}:AloneGenerator", "max_new_tokens": 4, "stamps": str(where)},
                   "resources": {"ranks": 1, "cpus_per_rank": 0.5}},
        "reference": {"infer": {"engine": f"{MODULE}:SlowInfer", "stamps": str(where)}},
        "algorithm": {"name": "grpo", "mini_batch_size": 8},
        "trainer": {"steps": 1, "prompts_per_step": 4, "samples_per_prompt": 2},
    })
    coord = Coordinator(topology(cfg, tiny_model, {"policy": 1})).start()
    try:
        t = stamps(where)
        assert set(t) == {"preload", "alone-start", "alone-end", "infer-start", "infer-end"}
        assert len(coord.pids["policy"]) == 1 and len(coord.pids["rollout"]) == 1 and len(coord.pids["reference"]) == 1
        # the generator's imports began in its own process, before its build
        assert (where / f"preload-{coord.pids['rollout'][0]}").is_file() and t["preload"] <= t["alone-start"]
        assert t["alone-start"] > t["infer-end"], "the alone engine was built while the reference was"
        # the start-up's timeline: every handle up, then built, then all ready
        up = coord.startup
        assert 0 <= up["ray_s"] < up["ready_s"]  # 0: the test session's Ray runs already
        for name in ("policy", "rollout", "reference"):
            assert up["ray_s"] <= up[f"{name}/up_s"] <= up[f"{name}/built_s"] <= up["ready_s"], (name, up)
        assert up["rollout/built_s"] >= up["reference/built_s"]  # the alone engine last
        assert up["policy/train_s"] > 0 and up["rollout/generate_s"] > 0
    finally:
        coord.shutdown()


def test_a_preloading_handles_workers_get_their_engines_in_the_constructor(monkeypatch):
    """The imports begin in the worker's constructor: a first call would wait for the driver to
    hear that the actor is up (0-0.4 s of W's warm start on an H100). Workers whose engines
    import nothing at ``preload`` get none."""
    from types import SimpleNamespace

    from xrlhf.coordinator import coordinator as cmod
    from xrlhf.engines.base import EngineSpec

    made = []

    class Actor:  # ray.remote(...)(EngineWorker): records the constructor's arguments; no method calls
        def options(self, **kwargs):
            return self

        def remote(self, *args):
            made.append(args)
            return SimpleNamespace()

    monkeypatch.setattr(cmod.ray, "remote", lambda **kwargs: (lambda cls: Actor()))
    coord = SimpleNamespace(topology=SimpleNamespace(concurrent_generate=0))
    slot = SimpleNamespace(options=lambda rank: {}, threads=2)
    spec = EngineSpec("m")
    gen = {"generate": ("vllm", spec)}
    cmod.Coordinator._spawn(coord, SimpleNamespace(name="rollout", engines=gen, resources=SimpleNamespace(ranks=2)),
                            slot)
    assert made == [("rollout", 0, 2, gen), ("rollout", 1, 2, gen)]
    made.clear()
    hf = {"train": ("hf", spec)}
    cmod.Coordinator._spawn(coord, SimpleNamespace(name="policy", engines=hf, resources=SimpleNamespace(ranks=1)), slot)
    assert made == [("policy", 0, 2, None)]


def test_handles_that_preload_start_first_and_the_start_up_line():
    from xrlhf.coordinator.coordinator import _preloads, _startup_line
    from xrlhf.engines.base import EngineSpec

    spec = EngineSpec("m")
    assert _preloads({"generate": ("vllm", spec)})  # vLLM imports itself at preload: its workers start first
    assert not _preloads({"train": ("hf", spec), "infer": ("hf", spec)})
    line = _startup_line({"ray_s": 2.04, "policy/up_s": 5.0, "policy/train_s": 7.25, "policy/built_s": 12.5,
                          "rollout/up_s": 4.5, "rollout/imports_s": 8.0, "rollout/built_s": 20.0, "ready_s": 20.3})
    assert line == ("Ray 2.0; policy: up 5.0 (train 7.2), built 12.5; "
                    "rollout: up 4.5 (imports 8.0), built 20.0; ready 20.3")
    # a worker's own points in time (EngineWorker.setup's timeline) come first, in their order
    line = _startup_line({"ray_s": 2.0, "policy/up_s": 9.5, "policy/train_s": 3.7, "policy/built_s": 13.1,
                          "policy/called_s": 9.4, "policy/born_s": 2.7, "policy/init_s": 6.6, "policy/module_s": 3.5,
                          "policy/imported_s": 6.5, "ready_s": 13.5})
    assert line == ("Ray 2.0; policy: born 2.7, module 3.5, imported 6.5, init 6.6, called 9.4, up 9.5 (train 3.7), "
                    "built 13.1; ready 13.5")
    line = _startup_line({"ray_s": 2.0, "policy/up_s": 4.0, "policy/built_s": 7.0, "fork_server/started_s": -7.5,
                          "fork_server/plain_s": -0.7, "fork_server/imported_s": 3.5, "ready_s": 9.3})
    assert line.endswith("fork server: started -7.5, plain copy -0.7, imported 3.5; ready 9.3")


def test_the_fork_plan_puts_the_preloading_handles_apart():
    """A fork server imports the generator's engines last (``long``); every other handle's engines,
    with their specs (``fork_imports`` reads the model's config), go to its plain copy; where
    nothing preloads there is no plan (and no server)."""
    from types import SimpleNamespace

    from xrlhf.coordinator.forkserver import fork_plan
    from xrlhf.engines.base import EngineSpec

    spec = EngineSpec("m")
    gen = SimpleNamespace(engines={"generate": ("vllm", spec)})
    policy = SimpleNamespace(engines={"train": ("hf", spec)})
    reference = SimpleNamespace(engines={"infer": ("hf", spec)})
    plan = fork_plan([policy, gen, reference])
    assert plan == {"long": [("vllm", "generate", spec.options)],
                    "plain": [("hf", "train", spec), ("hf", "infer", spec)]}
    assert fork_plan([policy, reference]) == {}


def test_a_workers_timeline_is_in_order_and_since_its_process_began():
    import time

    from xrlhf.coordinator.worker import IMPORTED_AT, MODULE_AT
    from xrlhf.utils.timeline import process_start

    born = process_start()
    assert born is not None and born <= MODULE_AT <= IMPORTED_AT <= time.time()
    assert time.time() - born < 24 * 3600  # this process's start, not the machine's


def test_workers_of_a_local_ray_see_the_variables_and_the_driver_keeps_its_own():
    """``init_ray`` starts a local Ray with its variables in this process's environment (its
    workers inherit it: no runtime environment to wait for), then puts this process's back. Its
    workers run at nice 0, not Ray's 15: beside a busy process they starved."""
    import os

    import ray

    @ray.remote(num_cpus=0.1)
    def seen() -> dict:
        return {"nice": os.nice(0), **{k: os.environ.get(k) for k in ("PYTHONPATH", "TOKENIZERS_PARALLELISM",
                                                                        "HF_HUB_OFFLINE")}}

    env = ray.get(seen.remote(), timeout=120)
    assert env["nice"] == 0
    assert os.getcwd() in env["PYTHONPATH"].split(os.pathsep)
    assert env["TOKENIZERS_PARALLELISM"] == "false" and env["HF_HUB_OFFLINE"] == "1"
    assert os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS") == ORIGINAL.get("HF_HUB_DISABLE_PROGRESS_BARS")


ORIGINAL = dict(__import__("os").environ)  # this process's variables before the session's Ray started
