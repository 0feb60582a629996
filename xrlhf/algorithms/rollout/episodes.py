"""Multi-turn episodes as token ids: run a batch of them against a generator, token in / token out.

Why token ids: decoding the model's turn and encoding the text again does not give back the
sampled ids (a BPE may split the same text otherwise; verl #6719, NeMo-RL #2821), and the
trainer would then score tokens the model never sampled. Here a trajectory is ``prompt_ids``
(the chat template on the first messages) + ``tokens``: each turn's sampled ids as sampled, then
the env's observation as the ids the template renders for it (``ChatFormat.observation_ids``),
then the next turn's ids... ``loss_mask`` is 1 on sampled ids and 0 on observation ids: the loss
trains on the model's tokens only, while the model attends to everything (the batch layout of
``xrlhf.data.batch``; GAE bridges the masked spans).

How turns are batched (``EpisodeRunner.continuous``): a generator whose engine serves concurrent
calls together (``GenerateEngine.batches_concurrent_calls``: vLLM's request loop) gets one call
per episode turn, sent the moment that episode is ready, each episode pinned to one rank:
continuous batching across turns, no episode waits for the slowest of the batch. Otherwise (the
Transformers engine) the episodes waiting for a turn go in *waves*: one call with all of them,
which is what a CPU batch needs. Either way turn ``t`` of sample ``i`` is drawn from its own seed
(``turn_seed``), so an episode is a function of its seed, its prompt and the weights.

Env steps run in a thread pool (a tool may take seconds), each bounded by the env's
``step_timeout_s`` (``xrlhf.utils.bounded``: a stuck step is abandoned and its episode ends
truncated, counted as ``step_timeouts``); an env that raises stops the run with the episode named
(a tool's own errors and time-outs are observations: ``xrlhf.tools.call_tool``). A stopping run
(``utils.bounded.STOPPING``: a few seconds after a first Ctrl-C, at once after a second) stops
waiting for user code: the episodes under way are abandoned and ``run`` raises
``UserCodeAborted``, leaving the stuck calls to their daemon threads.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from loguru import logger

from xrlhf.algorithms.rollout.types import Group, Reward, Sampling, Tally
from xrlhf.data.batch import Batch, build_sequences, right_padded
from xrlhf.data.chat import ChatFormat
from xrlhf.data.text import encode_prompt
from xrlhf.engines.base import GenerationOutput, SamplingParams
from xrlhf.envs.base import Prompt, clean_response
from xrlhf.envs.episode import Episode, EpisodeEnv, Turn
from xrlhf.utils.bounded import UserCodeAborted, UserCodeTimeout, call_bounded
from xrlhf.utils.errors import UserError
from xrlhf.utils.seeds import sample_seed, turn_seed
from xrlhf.utils.timeline import Timeline


@dataclass
class Trajectory:
    """One finished episode, as token ids (see the module docstring).

    Attributes:
        prompt_ids: the first context (chat template with its generation prompt).
        tokens: everything after it: sampled turns and observations, in order.
        loss_mask: per token of ``tokens``: 1 sampled, 0 observation.
        logprobs: per token: the sampler's logprob (0 on observations).
        versions: per token: the policy version that sampled it (0 on observations).
        turn_ends: index in ``tokens`` of each judged turn's last (stop) token.
        turn_rewards: the reward of each judged turn (``len(turn_ends)``); a truncated
            episode's judgement is added to its last token's reward.
        reward: the episode's return (the sum of its rewards).
        correct: the final judgement of a verifiable task (``None`` if none).
        truncated: a limit ended it (turns, tokens, a turn without a stop token).
        turns: model turns generated.
        counters: the sum over turns of ``Turn.info`` (``tool_calls``, ``tool_errors``, ...).
        actions: each turn's text as the env saw it.
    """

    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turn_ends: list[int] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    reward: float = 0.0
    correct: bool | None = None
    truncated: bool = False
    turns: int = 0
    counters: dict[str, float] = field(default_factory=dict)
    actions: list[str] = field(default_factory=list)

    done: bool = False
    """The env said done, or a limit truncated it."""
    prompt: Prompt | None = None
    """The prompt it answers (named by the log when its env stops answering)."""

    def context(self) -> list[int]:
        """What the model sees for its next turn: the prompt and everything so far."""
        return self.prompt_ids + self.tokens


class EpisodeRunner:
    """Runs episodes of ``env`` with ``generator`` (a handle: ``generate``, and ``generate_on``
    for ``continuous``); see the module docstring.

    Args:
        env: the episode env.
        tokenizer: the policy's tokenizer (with a chat template).
        generator: the handle that samples.
        continuous: one call per episode turn (engines that batch concurrent calls), else waves.
        ranks: the generator's ranks (``continuous``: episode ``i`` goes to rank ``i % ranks``).
        threads: env steps at once (tools run there).
    """

    def __init__(self, env: EpisodeEnv, tokenizer, generator, continuous: bool = False, ranks: int = 1,
                 threads: int = 8):
        self.env, self.tok, self.generator = env, tokenizer, generator
        self.chat = ChatFormat(tokenizer)
        self.continuous, self.ranks, self.threads = continuous, ranks, threads

    def stop_params(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the template's end-of-turn ids as stop tokens (a turn ends there)."""
        stops = list(dict.fromkeys([*params.stop_token_ids, *self.chat.stop_ids]))
        return dataclasses.replace(params, stop_token_ids=stops)

    def run(self, prompts: list[Prompt], seeds: list[int], params: SamplingParams) -> list[Trajectory]:
        """One episode per prompt (``seeds[i]``: sample ``i``'s seed) -> their trajectories.

        The env's code runs bounded (``EpisodeOptions.step_timeout_s``); when one episode fails,
        or the run stops, the others stop waiting for it at once and the pool is left without
        joining threads that user code holds.

        Raises:
            UserCodeAborted: the run is stopping (``utils.bounded.STOPPING``).
        """
        params = self.stop_params(params)
        abort = threading.Event()  # this call's: its pool's threads give up once one of them failed
        episodes = [self._start(p, abort) for p in prompts]
        trajs = [Trajectory(encode_prompt(self.tok, p), counters=dict.fromkeys(self.env.counters, 0.0), prompt=p)
                 for p in prompts]
        pool = ThreadPoolExecutor(max_workers=len(prompts) if self.continuous else self.threads,
                                  thread_name_prefix="episode")
        try:
            if self.continuous:
                futures = [pool.submit(self._run_one, i, e, t, seeds[i], params, abort)
                           for i, (e, t) in enumerate(zip(episodes, trajs))]
                for f in futures:
                    f.result()
            else:
                self._run_waves(pool, episodes, trajs, seeds, params, abort)
        except BaseException:
            abort.set()  # the pool's threads wait inside call_bounded: they return now
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown(wait=True)
        return trajs

    def _start(self, prompt: Prompt, abort: threading.Event) -> Episode:
        what = f"env {type(self.env).__name__}: start (prompt {prompt.text[:60]!r})"
        try:
            return call_bounded(lambda: self.env.start(prompt), self.env.config.step_timeout_s, what, abort)
        except (UserCodeTimeout, UserCodeAborted):
            raise
        except Exception as e:  # noqa: BLE001 - an env's bug is the user's to fix: name it
            raise UserError(f"{what} raised {type(e).__name__}: {e}; fix the env") from e

    def _run_one(self, i: int, episode: Episode, traj: Trajectory, seed: int, params: SamplingParams,
                 abort: threading.Event) -> None:
        limit = self.env.config.max_episode_tokens
        while not traj.done:
            if abort.is_set():  # another episode failed: no more generation for this one
                return
            p = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, limit - len(traj.tokens)))
            out = self.generator.generate_on(i % self.ranks, [traj.context()], p, [turn_seed(seed, traj.turns)])
            self.advance(episode, traj, _row(out, 0), params, abort)

    def _run_waves(self, pool: ThreadPoolExecutor, episodes: list[Episode], trajs: list[Trajectory],
                   seeds: list[int], params: SamplingParams, abort: threading.Event) -> None:
        while True:
            live = [i for i, t in enumerate(trajs) if not t.done]
            if not live:
                return
            out = self.generator.generate([trajs[i].context() for i in live], params,
                                          [turn_seed(seeds[i], trajs[i].turns) for i in live])
            list(pool.map(lambda k: self.advance(episodes[live[k]], trajs[live[k]], _row(out, k), params, abort),
                          range(len(live))))

    def advance(self, episode: Episode, traj: Trajectory, turn: tuple[list[int], list[float], list[int]],
                params: SamplingParams, abort: threading.Event | None = None) -> None:
        """Append one sampled turn to ``traj``, let the env answer, append its observation
        (``abort``: set when the env's answer is no longer waited for)."""
        ids, lps, vers = turn
        room = self.env.config.max_episode_tokens - len(traj.tokens)
        ids, lps, vers = ids[:room], lps[:room], (vers or [0] * len(ids))[:room]
        traj.tokens += ids
        traj.loss_mask += [1] * len(ids)
        traj.logprobs += lps
        traj.versions += vers
        traj.turns += 1
        if not ids or ids[-1] not in params.stop_token_ids:  # hit max_new_tokens or the budget
            return self._truncate(episode, traj)
        text = clean_response(self.tok.decode(ids[:-1], skip_special_tokens=True))
        traj.actions.append(text)
        answer = self._step(episode, traj, text, abort)
        if answer is None:  # the env did not answer in time: the episode ends here
            return self._abandon(traj)
        traj.turn_ends.append(len(traj.tokens) - 1)
        traj.turn_rewards.append(float(answer.reward))
        for k, v in answer.info.items():
            traj.counters[k] = traj.counters.get(k, 0.0) + float(v)
        if answer.done:
            traj.correct, traj.done = answer.correct, True
            traj.reward = sum(traj.turn_rewards)
            return
        obs = self.chat.observation_ids(answer.observation) if answer.observation is not None else []
        if traj.turns >= self.env.config.max_turns or len(traj.tokens) + len(obs) >= self.env.config.max_episode_tokens:
            return self._truncate(episode, traj)
        traj.tokens += obs
        traj.loss_mask += [0] * len(obs)
        traj.logprobs += [0.0] * len(obs)
        traj.versions += [0] * len(obs)

    def _step(self, episode: Episode, traj: Trajectory, text: str, abort: threading.Event | None) -> Turn | None:
        """The env's answer to a turn, bounded by ``step_timeout_s`` (``None``: it took longer)."""
        prompt = traj.prompt.text[:60] if traj.prompt is not None else ""
        what = f"env {type(self.env).__name__}: Episode.step (prompt {prompt!r}, turn {traj.turns})"
        try:
            answer = call_bounded(lambda: episode.step(text), self.env.config.step_timeout_s, what, abort)
        except UserCodeTimeout as e:
            logger.warning(f"{e}; the episode ends truncated (env.options.step_timeout_s)")
            return None
        except UserCodeAborted:
            raise
        except Exception as e:  # noqa: BLE001 - an env's bug is the user's to fix: name it
            raise UserError(f"env {type(self.env).__name__}: Episode.step raised {type(e).__name__}: {e} "
                            f"(turn {traj.turns}); fix the env (a tool's errors should be observations)") from e
        if not isinstance(answer, Turn):
            raise UserError(f"env {type(self.env).__name__}: Episode.step returned {type(answer).__name__}, "
                            f"expected xrlhf.envs.episode.Turn")
        if not answer.done and answer.observation is None:
            raise UserError(f"env {type(self.env).__name__}: a turn that is not done needs an observation")
        return answer

    def _abandon(self, traj: Trajectory) -> None:
        """End an episode whose env stopped answering: truncated, its rewards so far, counted."""
        traj.truncated, traj.done = True, True
        traj.counters["step_timeouts"] = traj.counters.get("step_timeouts", 0.0) + 1.0
        traj.reward = sum(traj.turn_rewards)

    def _truncate(self, episode: Episode, traj: Trajectory) -> None:
        score = episode.truncated()
        traj.truncated, traj.done, traj.correct = True, True, score.correct
        if traj.tokens:  # the judgement of the cut-short episode lands on its last token
            if not traj.turn_ends or traj.turn_ends[-1] != len(traj.tokens) - 1:
                traj.turn_ends.append(len(traj.tokens) - 1)
                traj.turn_rewards.append(0.0)
            traj.turn_rewards[-1] += float(score.reward)
        traj.reward = sum(traj.turn_rewards)


def _row(out: GenerationOutput, k: int) -> tuple[list[int], list[float], list[int]]:
    ids = out.token_ids[k]
    return ids, out.logprobs[k] if out.logprobs else [0.0] * len(ids), out.versions[k] if out.versions else []


def episode_batch(trajs: list[Trajectory], pad_id: int, mask_truncated: bool = False) -> Batch:
    """The trajectories in the batch layout of ``xrlhf.data.batch``.

    Returns:
        ``input_ids`` / ``attention_mask`` ``[B, P + R]``; ``response_mask`` ``[B, R]`` (the loss
        mask: 0 on observations, and on a whole truncated row when ``mask_truncated``);
        ``rollout_logprobs``, ``token_versions`` ``[B, R]``; ``turn_rewards`` ``[B, R]`` (each
        turn's reward on its last token: they sum to the return); ``truncated`` ``[B]``.
    """
    masks = [[0] * len(t.tokens) if (mask_truncated and t.truncated) else t.loss_mask for t in trajs]
    batch = build_sequences([t.prompt_ids for t in trajs], [t.tokens for t in trajs], pad_id,
                            [t.logprobs for t in trajs], response_masks=masks)
    shape = batch["response_mask"].shape
    rewards = torch.zeros(shape, dtype=torch.float32)
    for i, t in enumerate(trajs):
        for end, r in zip(t.turn_ends, t.turn_rewards):
            rewards[i, end] += r
    batch["token_versions"] = right_padded([t.versions for t in trajs], shape[1])
    batch["turn_rewards"] = rewards
    batch["truncated"] = torch.tensor([float(t.truncated) for t in trajs])
    return batch


def episode_metrics(trajs: list[Trajectory], prefix: str = "episode/") -> dict[str, float]:
    """Means over episodes: ``turns``, ``tokens`` (after the prompt), ``sampled_tokens``,
    ``truncated`` (fraction), ``correct`` (where judged) and every counter (``tool_calls``,
    ``tool_errors``, ...; an episode without it counts 0)."""
    n = len(trajs)
    m: dict[str, Any] = {f"{prefix}turns_mean": sum(t.turns for t in trajs) / n,
                         f"{prefix}tokens_mean": sum(len(t.tokens) for t in trajs) / n,
                         f"{prefix}sampled_tokens_mean": sum(sum(t.loss_mask) for t in trajs) / n,
                         f"{prefix}truncated_frac": sum(t.truncated for t in trajs) / n}
    judged = [t for t in trajs if t.correct is not None]
    if judged:
        m[f"{prefix}correct_frac"] = sum(bool(t.correct) for t in judged) / len(judged)
    for key in sorted({k for t in trajs for k in t.counters}):
        m[f"{prefix}{key}_mean"] = sum(t.counters.get(key, 0.0) for t in trajs) / n
    return m


class Episodes:
    """Samples and scores the groups of an episode env: ``n`` episodes of each prompt, each scored
    by its env as it ends (its return) or, with ``score_with_env`` false (``reward.source`` model
    or function), the whole trajectory by the run's reward source.

    Args:
        sampling: samples per prompt, parameters, seed.
        runner: runs the episodes on the generator.
        reward: the run's reward source.
        score_with_env: the env's returns are the scores.
        timeline: where generation and scoring spans go.
    """

    def __init__(self, sampling: Sampling, runner: EpisodeRunner, reward: Reward, score_with_env: bool,
                 timeline: Timeline):
        self.s, self.runner, self.reward, self.score_with_env, self.timeline = (sampling, runner, reward,
                                                                              score_with_env, timeline)

    def groups(self, prompts: list[Prompt], b: int, attempt: int, tally: Tally) -> list[Group]:
        """``n`` scored episodes of each of ``prompts``, as batch ``b``'s round ``attempt``."""
        n = self.s.n
        expanded = [p for p in prompts for _ in range(n)]
        seeds = [sample_seed(self.s.seed, b, row, attempt) for row in range(len(expanded))]
        t0 = time.time()
        with self.timeline.span("generator", f"b{b}"):
            trajs = self.runner.run(expanded, seeds, self.s.params)
        tally.generate_s += time.time() - t0
        tally.tokens += float(sum(sum(t.loss_mask) for t in trajs))
        texts = [t.actions[-1] if t.actions else "" for t in trajs]
        if self.score_with_env:
            scores = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
        else:
            t0 = time.time()
            with self.timeline.span("reward", f"b{b}"):
                scores, metrics = self.reward(expanded, texts, episode_batch(trajs, self.runner.tok.pad_token_id))
            scores = scores.float()
            tally.add_reward_metrics(metrics, len(prompts))
            tally.reward_s += time.time() - t0
        return [Group(p, trajs[g * n].prompt_ids, [t.tokens for t in trajs[g * n:(g + 1) * n]],
                      [t.logprobs for t in trajs[g * n:(g + 1) * n]], [t.versions for t in trajs[g * n:(g + 1) * n]],
                      texts[g * n:(g + 1) * n], scores[g * n:(g + 1) * n], trajs[g * n:(g + 1) * n])
                for g, p in enumerate(prompts)]

    def assemble(self, groups: list[Group]) -> tuple[Batch, dict[str, float]]:
        """The groups' trajectories as one batch, and the episode metrics."""
        trajs = [t for g in groups for t in g.trajs]
        batch = episode_batch(trajs, self.runner.tok.pad_token_id, self.runner.env.config.mask_truncated)
        if not self.score_with_env:  # the reward source scored whole trajectories
            del batch.tensors["turn_rewards"]
        if not self.s.params.logprobs:  # none asked for: no zeros that would read as logprobs
            del batch.tensors["rollout_logprobs"]
        return batch, episode_metrics(trajs)


