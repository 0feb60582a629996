"""The trainers' seam (``engines.handles``) behaves the same in both its homes: one table of
calls run on the Ray ``Coordinator`` and on the in-process ``LocalHandles``, built on the same
tiny model, gives the same roles, the same greedy tokens, the same logprobs and the same step."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import policy_batch
from xrlhf.algorithms.local import LocalHandle, LocalHandles
from xrlhf.algorithms.losses import PolicyLoss
from xrlhf.data.text import load_tokenizer
from xrlhf.engines.base import EngineSpec, SamplingParams
from xrlhf.engines.handles import Handles

pytestmark = pytest.mark.usefixtures("ray_session")

TRAIN = {"lr": 1e-3, "micro_batch_size": 8}
GREEDY = SamplingParams(max_new_tokens=3, temperature=0)
PROMPTS = [[1, 5, 6], [1, 7], [1, 8, 9, 10]]


@pytest.fixture(scope="module")
def both(tiny_model):
    """``{"ray": Coordinator, "local": LocalHandles}``: policy (train, a co-located generator),
    critic, reference; no reward model, no teacher."""
    from xrlhf.coordinator import Coordinator
    from xrlhf.engines.hf import HFGenerateEngine, HFInferEngine, HFTrainEngine
    from xrlhf.topology import topology
    from xrlhf.validation import validate_dict

    cfg = validate_dict({
        "name": "seam", "seed": 0, "ray": {"num_cpus": 2},
        "env": {"name": "reasoning", "options": {"eval_size": 8}},
        "policy": {"model": tiny_model, "train": TRAIN, "generate": {"max_new_tokens": 3},
                   "resources": {"ranks": 1, "cpus_per_rank": 1}},
        "critic": {"train": TRAIN}, "reference": {},
        "algorithm": {"name": "ppo", "mini_batch_size": 8, "kl_coef": 0.05},
        "trainer": {"steps": 1, "prompts_per_step": 8}})
    ray_run = Coordinator(topology(cfg, tiny_model)).start()
    spec = lambda head, options: EngineSpec(model_path=tiny_model, head=head, seed=0, options=options)  # noqa: E731
    local = LocalHandles(LocalHandle.of("policy", train=HFTrainEngine(spec("causal_lm", TRAIN)),
                                        generate=HFGenerateEngine(spec("causal_lm", {}))),
                         critic=LocalHandle.of("critic", train=HFTrainEngine(spec("value", TRAIN))),
                         reference=LocalHandle.of("reference", infer=HFInferEngine(spec("causal_lm", {}))))
    yield {"ray": ray_run, "local": local}
    ray_run.shutdown()


def roles(h: Handles) -> dict[str, bool]:
    return {r: getattr(h, r) is not None for r in ("policy", "generator", "critic", "reference", "reward", "teacher")}


def generate(h: Handles):
    out = h.generator.generate(PROMPTS, GREEDY)
    later = h.generator.generate(PROMPTS, GREEDY, wait=False).get()  # a Pending gathers the same
    assert later.token_ids == out.token_ids
    return out.token_ids


def reference_logprobs(h: Handles, tok) -> torch.Tensor:
    return h.reference.infer(policy_batch(tok))["logprobs"]


def train_step(h: Handles, tok) -> dict[str, float]:
    metrics = h.policy.train_step(policy_batch(tok), PolicyLoss(entropy_coef=0.01))
    return {k: float(v) for k, v in metrics.items()}


def sync_and_end(h: Handles) -> tuple[bool, set[str]]:
    seconds = h.sync_weights(1)
    h.end_rollout()
    return seconds >= 0, set(h.memory())


CALLS = [("roles", lambda h, tok: roles(h)), ("generate", lambda h, tok: generate(h)),
         ("reference.infer", reference_logprobs), ("policy.train_step", train_step),
         ("sync_weights, end_rollout, memory", lambda h, tok: sync_and_end(h)),
         ("generate after the sync", lambda h, tok: len(generate(h)))]
"""The table: each call's name and what it returns on a run's handles, in order (a call may
depend on the ones before: the sync sends the trained weights)."""


def test_one_table_of_calls_gives_the_same_on_ray_and_in_process(both, tiny_model):
    tok = load_tokenizer(tiny_model)
    for name, run in CALLS:
        got = {home: run(h, tok) for home, h in both.items()}
        ray_out, local_out = got["ray"], got["local"]
        if isinstance(ray_out, torch.Tensor):
            torch.testing.assert_close(ray_out, local_out, atol=1e-5, rtol=1e-5, msg=name)
        elif name == "policy.train_step":
            assert ray_out.keys() == local_out.keys(), name
            for k in ray_out:  # same weights, same batch: the same step (thread counts differ)
                assert ray_out[k] == pytest.approx(local_out[k], rel=1e-4, abs=1e-5), (name, k)
        else:
            assert ray_out == local_out, name
    assert roles(both["local"]) == {"policy": True, "generator": True, "critic": True, "reference": True,
                                    "reward": False, "teacher": False}
