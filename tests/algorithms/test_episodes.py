"""Multi-turn episodes (``algorithms/episodes.py``): token in / token out, masks, limits, rewards,
waves and continuous batching, and the loss's independence from observation tokens."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from xrlhf.algorithms.rollout.episodes import EpisodeRunner, episode_batch, episode_metrics
from xrlhf.algorithms.rollout.evaluate import evaluate_episodes
from xrlhf.utils.seeds import turn_seed
from xrlhf.algorithms.local import LocalHandle
from xrlhf.data.chat import ChatFormat
from xrlhf.data.text import load_tokenizer
from xrlhf.engines.base import EngineSpec, GenerationOutput, SamplingParams
from xrlhf.envs.base import Prompt
from xrlhf.envs.episode import Episode, EpisodeEnv, EpisodeOptions, Turn
from xrlhf.utils.errors import UserError

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=12)
HANG = threading.Event()


class Script:
    """A generator handle that answers each episode's turn with scripted text, tokenized as the
    test says (``split``: one id per character even where a tokenizer would merge), and records
    the contexts and seeds it was called with."""

    def __init__(self, tok, turns: dict[str, list[str]], stop: int, world_size: int = 1):
        self.tok, self.turns, self.stop, self.world_size = tok, turns, stop, world_size
        self.calls: list[tuple[int | None, list[list[int]], list[int]]] = []

    def key(self, context: list[int]) -> str:
        text = self.tok.decode(context)
        return next(k for k in self.turns if k in text)

    def _answer(self, context: list[int]) -> list[int]:
        replies = self.turns[self.key(context)]
        reply = replies[min(context.count(self.stop), len(replies) - 1)]  # one stop id per turn so far
        return self.tok.encode(reply, add_special_tokens=False) + ([] if reply.endswith("~") else [self.stop])

    def generate(self, prompts, params, seeds=None, *, wait=True, rank=None):
        self.calls.append((rank, prompts, seeds))  # (list.append is atomic: calls from threads)
        ids = [self._answer(p) for p in prompts]
        return GenerationOutput(ids, [[-0.5] * len(i) for i in ids], [[3] * len(i) for i in ids])

    def generate_on(self, rank, prompts, params, seeds=None, *, wait=True):
        return self.generate(prompts, params, seeds, rank=rank)


class Echo(EpisodeEnv):
    """Turn ``t``'s answer "ok" ends the episode with reward 1; anything else gets the
    observation "again <t>" and reward -0.1; "boom" raises."""

    Config = EpisodeOptions

    def train_prompts(self, start, n):
        return [Prompt(f"q{i}", messages=({"role": "user", "content": f"q{i}"},), index=i) for i in range(start, start + n)]

    def eval_prompts(self):
        return self.train_prompts(0, 3)

    def start(self, prompt):
        return _Echo()


class _Echo(Episode):
    def __init__(self):
        self.t = 0

    def step(self, action):
        self.t += 1
        if action == "boom":
            raise RuntimeError("kaput")
        if action == "hang":
            HANG.wait(60)  # an env that never answers in time (released by its test)
        if action == "ok":
            return Turn(reward=1.0, done=True, correct=True, info={"tool_calls": 0.0})
        return Turn({"role": "tool", "content": f"again {self.t}"}, reward=-0.1, info={"tool_calls": 1.0})


@pytest.fixture(scope="module")
def tok(tiny_model):
    return load_tokenizer(tiny_model)


@pytest.fixture(scope="module")
def chat(tok):
    return ChatFormat(tok)


def run(tok, chat, turns, options=None, continuous=False, world_size=1):
    env = Echo(EpisodeOptions(**(options or {})))
    gen = Script(tok, turns, chat.stop_ids[0], world_size)
    runner = EpisodeRunner(env, tok, gen, continuous=continuous, ranks=world_size)
    prompts = env.train_prompts(0, len(turns))
    return runner.run(prompts, [10 + i for i in range(len(prompts))], PARAMS), gen


def test_token_in_token_out_equals_the_template_of_the_whole_conversation(tok, chat):
    trajs, _ = run(tok, chat, {"q0": ["1+1", "ok"], "q1": ["ok"]})
    t = trajs[0]
    conversation = [{"role": "user", "content": "q0"}, {"role": "assistant", "content": "1+1"},
                    {"role": "tool", "content": "again 1"}, {"role": "assistant", "content": "ok"}]
    full = tok.apply_chat_template(conversation, tokenize=False)
    expected = tok.encode(full, add_special_tokens=False)
    got = t.prompt_ids + t.tokens
    assert got == expected[:len(got)] and len(expected) - len(got) <= 1  # the template may close with "\n"
    obs = chat.observation_ids({"role": "tool", "content": "again 1"})
    first = len(tok.encode("1+1", add_special_tokens=False)) + 1
    assert t.loss_mask == [1] * first + [0] * len(obs) + [1] * (len(t.tokens) - first - len(obs))
    assert t.tokens[first:first + len(obs)] == obs
    assert t.logprobs[first:first + len(obs)] == [0.0] * len(obs) and t.versions[first] == 0
    assert (t.turns, t.correct, t.truncated, t.reward) == (2, True, False, pytest.approx(0.9))
    assert t.turn_rewards == [-0.1, 1.0] and t.turn_ends == [first - 1, len(t.tokens) - 1]
    assert t.actions == ["1+1", "ok"] and t.counters == {"tool_calls": 1.0}
    assert trajs[1].turns == 1 and trajs[1].reward == 1.0


def test_sampled_ids_are_kept_as_sampled_never_re_encoded(tok, chat):
    """A non-canonical tokenization of the model's turn stays in the trajectory as sampled."""
    env = Echo()
    weird = [tok.convert_tokens_to_ids("o"), tok.convert_tokens_to_ids("k"), chat.stop_ids[0]]

    class Raw:
        world_size = 1

        def generate(self, prompts, params, seeds=None, *, wait=True):
            return GenerationOutput([list(weird) for _ in prompts], [[-1.0] * 3 for _ in prompts])

    trajs = EpisodeRunner(env, tok, Raw()).run(env.train_prompts(0, 1), [0], PARAMS)
    assert trajs[0].tokens == weird and trajs[0].actions == ["ok"]


def test_limits_truncate_and_are_marked(tok, chat):
    trajs, _ = run(tok, chat, {"q0": ["no"], "q1": ["no~"], "q2": ["ok"]}, {"max_turns": 3, "max_episode_tokens": 200})
    assert trajs[0].truncated and trajs[0].turns == 3 and trajs[0].correct is False
    assert trajs[1].truncated and trajs[1].turns == 1  # a turn without a stop token
    assert not trajs[2].truncated
    trajs, _ = run(tok, chat, {"q0": ["no"]}, {"max_turns": 9, "max_episode_tokens": 20})
    assert trajs[0].truncated and len(trajs[0].tokens) <= 20
    b = episode_batch(trajs, tok.pad_token_id, mask_truncated=True)
    assert b["response_mask"].sum() == 0 and b["truncated"].tolist() == [1.0]
    m = episode_metrics(trajs)
    assert m["episode/truncated_frac"] == 1.0 and m["episode/correct_frac"] == 0.0


def test_episode_batch_layout_and_turn_rewards(tok, chat):
    trajs, _ = run(tok, chat, {"q0": ["1+1", "ok"], "q1": ["ok"]})
    b = episode_batch(trajs, tok.pad_token_id)
    p = b["input_ids"].shape[1] - b["response_mask"].shape[1]
    for i, t in enumerate(trajs):
        assert b["input_ids"][i, p:p + len(t.tokens)].tolist() == t.tokens
        assert b["attention_mask"][i, p:p + len(t.tokens)].sum() == len(t.tokens)
        assert b["response_mask"][i, :len(t.tokens)].tolist() == [float(x) for x in t.loss_mask]
        assert float(b["turn_rewards"][i].sum()) == pytest.approx(t.reward)
        for end, r in zip(t.turn_ends, t.turn_rewards):
            assert float(b["turn_rewards"][i, end]) == pytest.approx(r)
    assert b["token_versions"][0, 0] == 3


def test_an_env_that_raises_is_named(tok, chat):
    with pytest.raises(UserError, match="Echo: Episode.step raised RuntimeError: kaput"):
        run(tok, chat, {"q0": ["boom"]})


@pytest.mark.parametrize("continuous", [False, True])
def test_an_env_that_never_answers_ends_its_episode_not_the_run(tok, chat, continuous):
    """``step_timeout_s``: the stuck step is abandoned, its episode ends truncated and is counted;
    the other episodes go on, and the run never waits for the stuck call."""
    HANG.clear()
    t0 = time.monotonic()
    try:
        trajs, _ = run(tok, chat, {"q0": ["1+1", "hang"], "q1": ["ok"]}, {"step_timeout_s": 0.5}, continuous=continuous)
    finally:
        HANG.set()  # the abandoned call ends (other tests list the calls still running)
    assert time.monotonic() - t0 < 20
    stuck, fine = trajs
    assert stuck.truncated and stuck.counters["step_timeouts"] == 1 and stuck.turns == 2
    assert stuck.reward == pytest.approx(-0.1)  # the turn it answered
    assert fine.reward == 1.0 and not fine.truncated and "step_timeouts" not in fine.counters
    assert episode_metrics(trajs)["episode/step_timeouts_mean"] == 0.5


def test_waves_and_continuous_route_and_seed_alike(tok, chat):
    turns = {"q0": ["a", "ok"], "q1": ["ok"], "q2": ["b", "c", "ok"]}
    waves, wgen = run(tok, chat, turns)
    cont, cgen = run(tok, chat, turns, continuous=True, world_size=2)
    assert [w.tokens for w in waves] == [c.tokens for c in cont]
    assert len(wgen.calls) == 3 and [len(c[1]) for c in wgen.calls] == [3, 2, 1]  # waves shrink
    assert len(cgen.calls) == 6 and all(len(c[1]) == 1 for c in cgen.calls)  # one call per turn
    ranks = {cgen.key(c[1][0]): c[0] for c in cgen.calls}
    assert ranks == {"q0": 0, "q1": 1, "q2": 0}
    assert sorted(s for c in cgen.calls for s in c[2]) == sorted(s for c in wgen.calls for s in c[2])
    assert turn_seed(12, 0) == 12 and turn_seed(12, 1) != turn_seed(12, 2)


def test_real_engine_waves_and_continuous_equal(tiny_model, tok):
    """The Transformers engine runs episodes (keyed rows): waves and one call per turn give the
    same trajectories, and greedy evaluation reports episode metrics."""
    gen = LocalHandle.build("policy", {"generate": ("hf", EngineSpec(tiny_model, seed=0))})
    env = Echo(EpisodeOptions(max_turns=2, max_episode_tokens=40))
    stop = list(range(3, 128))  # every printable char stops a turn: short turns, several per episode
    params = SamplingParams(temperature=1.0, max_new_tokens=4, stop_token_ids=stop)
    prompts = env.train_prompts(0, 4)
    waves = EpisodeRunner(env, tok, gen).run(prompts, [1, 2, 3, 4], params)
    cont = EpisodeRunner(env, tok, gen, continuous=True).run(prompts, [1, 2, 3, 4], params)
    assert [t.tokens for t in waves] == [t.tokens for t in cont]
    assert any(t.turns == 2 for t in waves)
    for t in waves:
        torch.testing.assert_close(torch.tensor(t.logprobs), torch.tensor([c for c in cont[waves.index(t)].logprobs]),
                                   atol=1e-5, rtol=0)
    m = evaluate_episodes(EpisodeRunner(env, tok, gen), params, limit=3)
    assert {"eval/reward_mean", "eval/turns_mean", "eval/truncated_frac"} <= set(m)


def test_observation_tokens_do_not_reach_the_gradient(tiny_model, tok, chat):
    """Changing the logits at every position that predicts an observation token leaves the
    policy loss's gradient unchanged: the env's tokens are masked out of the loss."""
    from transformers import AutoModelForCausalLM

    from xrlhf.algorithms import functional as F
    from xrlhf.engines.hf import token_logprobs

    trajs, _ = run(tok, chat, {"q0": ["1+1", "2", "ok"], "q1": ["x", "ok"]})
    b = episode_batch(trajs, tok.pad_token_id)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    R = b["response_mask"].shape[1]
    obs = (b["response_mask"] == 0) & (b["attention_mask"][:, -R:] == 1)
    assert obs.any()
    adv = torch.linspace(-1, 1, R).expand_as(b["response_mask"]).contiguous()

    def grads(noise: bool):
        model.zero_grad()
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, -R - 1:-1]
        if noise:  # position j of the response is predicted by logits j - 1 of the slice
            logits = torch.where(obs[..., None], logits + 5 * torch.randn_like(logits), logits)
        lp = token_logprobs(logits, b["input_ids"][:, -R:])
        loss, _ = F.policy_loss(lp, lp.detach(), adv, b["response_mask"], 0.2)
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    for g0, g1 in zip(grads(False), grads(True)):
        torch.testing.assert_close(g0, g1, atol=0, rtol=0)
