"""LoRA end to end through Ray: ``configs/grpo_lora.yaml`` shortened learns (the eval reward rises)
while only the adapters change (the final adapter, applied to the unchanged base with PEFT, gives
the run's own eval); and PPO on DeepSpeed ZeRO-3 over two ranks with LoRA policy and critic, the
reference from the policy's base, the generator fed merged weights in the split layout, verified."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[2]
SHORT = ["trainer.steps=60", "trainer.eval_every=0", "env.options.eval_size=128", "policy.train.lora.save=adapter",
         "policy.train.lr=1.0e-3"]
GAIN = 0.05
"""60 steps at lr 1e-3 (the config's lr before it was retuned to 5e-4 over 800 steps: a short run
needs the larger steps to move) and a held-out set half the config's (noisier). The shipped config
gains +0.28 to +0.38 over seeds 0-2 (docs/algorithms.md)."""


def cli(args: list[str], timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "xrlhf.cli", "run", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def greedy_eval(model_dir: str, env_options: dict, limit: int) -> float:
    """The held-out greedy reward of a model directory, as the trainer's ``evaluate`` computes it."""
    from xrlhf.algorithms.local import LocalHandle
    from xrlhf.algorithms.rollout.evaluate import evaluate
    from xrlhf.data.text import load_tokenizer
    from xrlhf.engines.base import EngineSpec, SamplingParams
    from xrlhf.engines.hf import HFGenerateEngine
    from xrlhf.envs import build_env

    gen = HFGenerateEngine(EngineSpec(model_dir))
    env = build_env("reasoning", env_options, 0)
    params = SamplingParams(temperature=0, max_new_tokens=8)
    return evaluate(LocalHandle.of("rollout", generate=gen), env, load_tokenizer(model_dir), params,
                    limit)["eval/reward_mean"]


@pytest.mark.long  # a learning claim (60 steps, ~75 s on 2 cores): make test-long and CI run it
def test_grpo_lora_learns_and_changes_only_the_adapters(tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from xrlhf.models.tiny import build_model

    model = build_model(tmp_path / "model")
    out = tmp_path / "run"
    cli(["configs/grpo_lora.yaml", "--output-dir", str(out), f"policy.model={model}", *SHORT, "checkpoint.every=0"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_reward_final"] > summary["eval_reward_initial"] + GAIN, summary
    # final/ holds the adapters only; the base they apply to is the warm-up's output, untouched
    adapter = load_file(str(out / "final" / "adapter_model.safetensors"))
    assert adapter and all(".lora_A." in k or ".lora_B." in k for k in adapter)
    assert not (out / "final" / "model.safetensors").exists()
    policy = torch.load(next((out / "checkpoints").glob("step-*")) / "policy" / "state.pt", weights_only=False)
    assert sorted(policy["model"]) == sorted(k.replace(".lora_A.", ".lora_A.default.").replace(
        ".lora_B.", ".lora_B.default.") for k in adapter)  # the checkpoint: adapters and their optimizer states
    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out / "warmup"), out / "final")
    merged.merge_and_unload().save_pretrained(tmp_path / "merged")
    for f in (out / "warmup").glob("tokenizer*"):
        (tmp_path / "merged" / f.name).write_bytes(f.read_bytes())
    options = {"tasks": ["add", "compare", "sort"], "max_operand": 20, "eval_size": 128}
    assert abs(greedy_eval(str(tmp_path / "merged"), options, 128) - summary["eval_reward_final"]) < 0.02


@pytest.mark.long  # ~1 minute or more beside a busy core: make test-all (CI) runs it, make test stays under 30 minutes
def test_ppo_lora_on_deepspeed_zero3_two_ranks_split_layout(tmp_path):
    from xrlhf.models.tiny import build_model

    pytest.importorskip("deepspeed")
    model = build_model(tmp_path / "model")
    out = tmp_path / "run"
    cli(["configs/quickstart_deepspeed.yaml", "--output-dir", str(out), f"policy.model={model}", "warmup.steps=0",
         "trainer.steps=2", "trainer.prompts_per_step=64", "env.options.eval_size=16", "policy.train.zero_stage=3",
         "policy.train.lora={rank: 4, alpha: 8}", "critic.train.lora={rank: 4}", "policy.resources.cpus_per_rank=0.5",
         "policy.generate.resources={ranks: 1, cpus_per_rank: 0.5}", "policy.weight_sync.verify=true",
         "checkpoint.every=1"], timeout=600)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "policy/grad_norm" in r]
    assert len(steps) == 2 and abs(steps[0]["kl/mean"]) < 1e-6  # the reference is the policy's base
    assert steps[1]["mismatch/logprob_abs_diff_mean"] < 1e-3  # the generator got the merged weights
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out / "final")  # save: merged (default) -> an HF model
    assert not list((out / "checkpoints").glob("step-*/reference*"))
