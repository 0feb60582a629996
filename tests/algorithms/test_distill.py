"""On-policy distillation's update on real tiny models, in process (``LocalHandles``, no Ray): the
advantages are the teacher's log-ratio on the student's tokens only, the student moves toward
the teacher, teacher completions mix in as NLL rows, and the config checks (a teacher with
another tokenizer, a teacher for another algorithm)."""

import pytest
import torch

from xrlhf.algorithms.build import build_trainer
from xrlhf.algorithms.base import Rollout
from xrlhf.algorithms.local import LocalHandle, LocalHandles
from xrlhf.algorithms.losses import SFTLoss
from xrlhf.algorithms.rewards import build_reward
from xrlhf.algorithms.warmup import sft_batch
from xrlhf.data.batch import build_sequences
from xrlhf.data.datasets import write_jsonl
from xrlhf.data.text import load_tokenizer
from xrlhf.engines.base import EngineSpec
from xrlhf.engines.hf import HFGenerateEngine, HFInferEngine, HFTrainEngine
from xrlhf.envs import build_env
from xrlhf.models.tiny import build_model
from xrlhf.utils.errors import UserError
from xrlhf.validation import algorithm_options, validate_dict
from xrlhf.utils.run_hooks import RunHooks


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A random tiny student, and a 3-layer teacher taught the reasoning answers for 40 steps (its
    distributions are far from the student's)."""
    root = tmp_path_factory.mktemp("distill")
    student, start = str(build_model(root / "student", seed=0)), str(build_model(root / "start", seed=1, layers=3))
    engine = HFTrainEngine(EngineSpec(model_path=start, options={"lr": 3e-3, "micro_batch_size": 64}, seed=0))
    env, tok = build_env("reasoning", {}, 0), load_tokenizer(start)
    for step in range(40):
        engine.train_step(sft_batch(env, tok, 64 * step, 64), SFTLoss())
    engine.save_pretrained(str(root / "teacher"))
    return student, str(root / "teacher")


def make_trainer(models, algorithm: dict | None = None, extra: dict | None = None, generate: bool = False, log=None,
                 topk: int = 0):
    student, teacher = models
    cfg = validate_dict({"env": {"name": "reasoning", "options": {"eval_size": 8}},
                         "policy": {"model": student, "train": {"lr": 3e-3}, "generate": {"max_new_tokens": 6}},
                         "reference": None, "teacher": {"model": teacher, "evaluate": False,
                                                        **({"infer": {"topk_logprobs": topk}} if topk else {})},
                         "algorithm": {"name": "distill", "mini_batch_size": 8, **(algorithm or {})},
                         "trainer": {"prompts_per_step": 4, "samples_per_prompt": 2}, **(extra or {})})
    spec = EngineSpec(model_path=student, options={"lr": 3e-3, "micro_batch_size": 32}, seed=0)
    gen = HFGenerateEngine(EngineSpec(student, options={"micro_batch_size": 32}, seed=0)) if generate else None
    scorer = HFInferEngine(EngineSpec(model_path=teacher, seed=0, options={"topk_logprobs": topk}))
    handles = LocalHandles(LocalHandle.of("policy", train=HFTrainEngine(spec), generate=gen),
                           teacher=LocalHandle.of("teacher", infer=scorer))
    env = build_env(cfg.env.name, cfg.env.options, cfg.seed)
    reward = build_reward(cfg, env, handles) if generate else None
    return build_trainer(cfg, algorithm_options(cfg), handles, env, load_tokenizer(student), reward=reward,
                         hooks=RunHooks(log=log or (lambda m: None)))


def rollout(masks=None) -> Rollout:
    """8 rows of made-up tokens; ``masks``: per row, 0 on 'environment' tokens."""
    prompts = [[1, 20 + i, 21] for i in range(8)]
    responses = [[30 + i, 31, 32 + i % 3, 2][: 2 + i % 3] for i in range(8)]
    batch = build_sequences(prompts, responses, 0, response_masks=masks)
    batch["scores"] = torch.tensor([1.0, 0.0] * 4)
    batch["group_ids"] = torch.arange(4).repeat_interleave(2)
    return Rollout(batch, [], [])


def infer(handle, batch):
    return handle.infer(batch.select("input_ids", "attention_mask", "response_mask"))["logprobs"]


@pytest.mark.parametrize("divergence", ["reverse_kl", "jsd"])
def test_advantages_are_the_teacher_log_ratio_on_model_tokens_only(models, divergence):
    trainer = make_trainer(models, {"divergence": divergence})
    masks = [[1.0, 0.0, 1.0, 1.0][: 2 + i % 3] for i in range(8)]  # the second token is the environment's
    r = rollout(masks)
    mask = r.batch["response_mask"]
    student, teacher = infer(trainer.policy, r.batch), infer(trainer.handles.teacher, r.batch)
    ratio = -(student - teacher) * mask
    if divergence == "reverse_kl":
        want = ratio
    else:  # -(1 - beta) log(p / m), m = (p + q) / 2, by hand
        want = -0.5 * (student - torch.log((student.exp() + teacher.exp()) / 2)) * mask
    metrics = trainer.update(r, {})
    adv = r.batch["advantages"]
    assert torch.allclose(adv, want, atol=1e-5)
    assert bool((adv[:, 1] == 0).all()) and bool((mask[:, 1] == 0).all())
    assert metrics["distill/reverse_kl"] == pytest.approx(float(-(ratio.sum() / mask.sum())), abs=1e-5)
    assert ("distill/jsd" in metrics) == (divergence == "jsd")
    assert metrics["perf/teacher_tokens_per_s"] > 0 and "teacher_logprobs" not in r.batch


def test_the_student_moves_toward_the_teacher(models):
    """The student samples (the one rollout path, in process) and the reverse KL to the teacher
    on its own fresh samples falls: the objective itself, measured where it is defined."""
    rows = []
    trainer = make_trainer(models, {"mini_batch_size": 32}, generate=True, log=rows.append,
                           extra={"trainer": {"steps": 30, "prompts_per_step": 16, "samples_per_prompt": 2}})
    trainer.fit()
    kl = [r["distill/reverse_kl"] for r in rows if "distill/reverse_kl" in r]
    assert len(kl) == 30
    assert all("distill/reverse_kl_wrong" in r for r in rows if "distill/reverse_kl" in r)  # the env judges
    assert sum(kl[-3:]) < 0.6 * sum(kl[:3]), kl


def test_task_reward_adds_the_grpo_advantage(models):
    plain, mixed = make_trainer(models), make_trainer(models, {"task_reward_weight": 0.5})
    a, b = rollout(), rollout()
    plain.update(a, {})  # both students start equal: the first update's advantages differ by the task term
    mixed.update(b, {})
    mask = a.batch["response_mask"]
    grpo = torch.tensor([0.7071, -0.7071] * 4)[:, None] * mask  # (1 - 0.5) / std([1, 0]) per pair
    assert torch.allclose(b.batch["advantages"] - a.batch["advantages"], 0.5 * grpo, atol=1e-3)


def test_teacher_completions_mix_in_as_nll_rows(models, tmp_path):
    rows = [{"prompt": f"q{i}", "completion": f"a{i}x"} for i in range(5)]
    data = write_jsonl(rows, tmp_path / "teacher.jsonl")
    trainer = make_trainer(models, {"offline_dataset": str(data), "offline_fraction": 0.2})
    r = rollout()
    trainer.update(r, {})
    batch = r.batch
    assert len(batch) == 10  # 8 on-policy rows + 8 * 0.2 / 0.8 = 2 teacher rows
    mask = batch["response_mask"]
    assert torch.equal(batch["advantages"][8:], mask[8:])  # +1 on each teacher token: their NLL
    assert [int(m.sum()) for m in mask[8:]] == [4, 4]  # three characters and EOS
    assert len(set(batch["group_ids"].tolist())) == 6 and float(batch["scores"][8:].abs().sum()) == 0


def test_a_teacher_with_another_tokenizer_is_one_line(models, tmp_path):
    bpe = build_model(tmp_path / "bpe", tokenizer="bpe", vocab_size=300, seed=0)
    with pytest.raises(UserError) as e:
        make_trainer((models[0], str(bpe)))
    (line,) = e.value.messages
    assert line.startswith("teacher.model: ") and "another tokenizer than policy.model" in line


def test_a_teacher_for_another_algorithm_is_refused(models):
    with pytest.raises(UserError) as e:
        validate_dict({"env": {"name": "reasoning"}, "policy": {"model": models[0]}, "teacher": {"model": models[1]},
                       "algorithm": {"name": "grpo", "mini_batch_size": 8}, "trainer": {"samples_per_prompt": 2}})
    assert any(m.startswith("teacher: algorithm 'grpo' uses no teacher") for m in e.value.messages)


def test_the_topk_term_pulls_the_student_toward_the_teachers_topk(models):
    """``topk_coef``: the teacher's top-k reach the loss, whose top-k reverse KL (the divergence
    itself, not a sampled cost) falls over updates on the same rows, and moves the weights
    beyond what the sampled-token advantages alone do."""
    with_topk, plain = make_trainer(models, {"topk_coef": 1.0}, topk=8), make_trainer(models)
    kls = [with_topk.update(rollout(), {})["distill/topk_kl"]]
    plain.update(rollout(), {})  # the same start, rows and sampled-token advantages: only the top-k term differs
    a, b = (dict(t.policy.hosts[0].train.named_weights()) for t in (with_topk, plain))
    assert any(not torch.equal(a[n], b[n]) for n in a)
    kls += [with_topk.update(rollout(), {})["distill/topk_kl"] for _ in range(3)]
    assert all(k > 0 for k in kls) and kls[-1] < kls[0], kls


def test_topk_options_come_in_pairs(models):
    with pytest.raises(UserError, match="algorithm.topk_coef: needs the teacher's top-k tokens"):
        make_trainer(models, {"topk_coef": 1.0})
    with pytest.raises(UserError, match="teacher.infer.topk_logprobs: only used with algorithm.topk_coef"):
        make_trainer(models, topk=4)
