"""The supervised warm-up saves like RL does (issue 49): by ``checkpoint.every`` warm-up steps, at a
stop and at its end; continued from its last checkpoint it ends with the weights of an
uninterrupted warm-up (in this process, no Ray; the run through the CLI killed with SIGKILL:
tests/e2e/test_stop.py)."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from xrlhf.algorithms.warmup import WarmupSaves, supervised_warmup
from xrlhf.checkpoint import WARMUP, SaveSchedule, list_checkpoints, resume_checkpoint
from xrlhf.data.text import load_tokenizer
from xrlhf.envs import build_env
from xrlhf.validation import validate_dict

STEPS = 6


def warm_up(config: dict, out, every: int = 0, stop_after: int | None = None, resume: bool = False):
    """The warm-up of ``config`` into ``out``; ``stop_after``: a stop asked after that many steps."""
    cfg = validate_dict(config)
    env = build_env(cfg.env.name, cfg.env.options, cfg.seed)
    asked = iter(range(10**6))
    stop = (lambda: next(asked) >= stop_after) if stop_after is not None else (lambda: False)
    saves = WarmupSaves(out, SaveSchedule(every, 0), 2, lambda: {"metrics_offset": 0, "wall_seconds": 0.0},
                        resume_checkpoint(out, WARMUP) if resume else None)
    return supervised_warmup(cfg, env, load_tokenizer(cfg.policy.model), cfg.policy.model, out, stop=stop,
                             saves=saves)


def weights(model_dir) -> dict[str, torch.Tensor]:
    return load_file(f"{model_dir}/model.safetensors")


def test_a_stopped_warmup_saves_and_continues_to_the_same_weights(base_config, tmp_path):
    base_config["warmup"] = {"steps": STEPS, "batch_size": 8}
    base_config["policy"]["resources"] = {"ranks": 1}
    straight, before = warm_up(base_config, tmp_path / "straight")
    assert [p.name for p in list_checkpoints(tmp_path / "straight", WARMUP)] == [f"warmup-{STEPS:08d}"]  # its end
    often, _ = warm_up(base_config, tmp_path / "often", every=2)  # saving does not change the numbers
    stopped_dir, again = warm_up(base_config, tmp_path / "stopped", stop_after=3)
    assert stopped_dir == base_config["policy"]["model"]  # stopped: no warmed-up model
    assert [p.name for p in list_checkpoints(tmp_path / "stopped", WARMUP)] == ["warmup-00000003"]
    resumed, kept = warm_up(base_config, tmp_path / "stopped", resume=True)
    assert kept == before == again  # the eval before it is kept, not run again
    assert [p.name for p in list_checkpoints(tmp_path / "stopped", WARMUP)] == ["warmup-00000003",
                                                                                f"warmup-{STEPS:08d}"]
    a = weights(straight)
    for other in (often, resumed):
        b = weights(other)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
