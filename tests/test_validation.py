"""``xrlhf validate`` catches what would fail after Ray start-up: bad dataset rows (all of them),
broken model configs, reward functions it cannot call, sequences longer than the model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from tests.conftest import build_gpt2
from xrlhf.data.datasets import write_jsonl
from xrlhf.models.tiny import build_model
from xrlhf.utils.errors import UserError
from xrlhf.validation import validate_dict


def errors_of(data: dict) -> list[str]:
    with pytest.raises(UserError) as e:
        validate_dict(data)
    return e.value.messages


@pytest.fixture()
def dpo_config(base_config, tmp_path) -> dict:
    rows = [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i)} for i in range(30)]
    rows[3] = {"prompt": "3+1=", "chosen": "4"}                       # missing 'rejected'
    rows[7]["chosen"] = 7                                              # not a string
    rows += [{"prompt": "x", "chosen": "y"} for _ in range(12)]       # 12 more bad rows
    path = write_jsonl(rows, tmp_path / "prefs.jsonl")
    base_config["algorithm"] = {"name": "dpo", "dataset": str(path), "batch_size": 8}
    base_config.pop("critic")
    return base_config


def test_every_bad_row_of_a_dataset_is_reported_capped(dpo_config):
    lines = errors_of(dpo_config)
    assert lines[0].startswith("algorithm.dataset: ") and lines[0].endswith(
        "prefs.jsonl:4: missing field 'rejected' (a preferences row needs prompt, chosen, rejected: "
        '{"prompt": "2+3=", "chosen": "5", "rejected": "6"})')
    assert "prefs.jsonl:8: field 'chosen' must be a string, got 7" in lines[1]
    assert len(lines) == 11 and lines[-1].endswith("... and 4 more bad rows")  # 14 bad rows, 10 shown


def test_a_corrupt_model_config_is_one_line(base_config, tmp_path):
    model = build_model(tmp_path / "m", seed=0)
    (model / "config.json").write_text('{"model_type": "llama", "hidden_size": 64,,}')
    (line,) = errors_of({**base_config, "policy": {**base_config["policy"], "model": str(model)}})
    assert line.startswith(f"policy.model: {model}/config.json is not valid JSON (Expecting")


def test_an_unknown_model_type_is_one_line(base_config, tmp_path):
    model = build_model(tmp_path / "m", seed=0)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "llamaa"}))
    base_config["reference"] = {"model": str(model)}
    (line,) = errors_of(base_config)
    assert line.startswith("reference.model: model_type 'llamaa' in ") and "not an architecture" in line


@pytest.mark.parametrize("fn,expected", [
    ("one_argument", "reward.function: tests.e2e.reward_fns:one_argument(responses) cannot be called as "
                     "fn(prompts, responses) or fn(prompts, responses, answers) (too many positional arguments)"),
    ("not_callable", "reward.function: tests.e2e.reward_fns:not_callable is a list, not a function"),
])
def test_a_reward_function_it_cannot_call_is_one_line(base_config, fn, expected):
    base_config["reward"] = {"source": "function", "function": f"tests.e2e.reward_fns:{fn}"}
    (line,) = errors_of(base_config)
    assert line.startswith(expected)


@pytest.mark.parametrize("arch,key", [("gpt2", "n_positions"), ("llama", "max_position_embeddings")])
def test_prompt_plus_max_new_tokens_beyond_the_models_positions(base_config, tmp_path, arch, key):
    # the longest reasoning prompt with the defaults is 'parity 1111:' plus BOS: 13 tokens
    model = (build_gpt2(tmp_path / "m", positions=24) if arch == "gpt2"
             else str(build_model(tmp_path / "m", seed=0, max_positions=24)))
    base_config["policy"]["model"] = model
    base_config["policy"]["generate"]["max_new_tokens"] = 12
    (line,) = errors_of(base_config)
    assert line.startswith("policy.generate.max_new_tokens: the longest prompt of env 'reasoning' (13 tokens) + "
                           "max_new_tokens 12 = 25 exceeds the 24 positions of ")
    assert f"({key} in config.json;" in line and line.endswith("lower it to at most 11")
    base_config["policy"]["generate"]["max_new_tokens"] = 11
    validate_dict(base_config)


def test_validate_cli_exit_2_one_line_each_no_traceback(dpo_config, tmp_path):
    dpo_config["reward"] = {"source": "function", "function": "tests.e2e.reward_fns:one_argument"}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(dpo_config))
    proc = subprocess.run([sys.executable, "-m", "xrlhf.cli", "validate", str(path)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert all(x.startswith("error: ") for x in lines) and len(lines) == 12  # all at once: 1 + 10 + "more"
    assert "reward.function: tests.e2e.reward_fns:one_argument" in lines[0]
    assert lines[1].startswith("error: algorithm.dataset: ") and "prefs.jsonl:4: missing field" in lines[1]


# -- the rollout section (asynchronous RL) ------------------------------------------------------
def test_rollout_rules_each_give_their_line(base_config):
    ppo = {**base_config, "rollout": {"max_staleness": 1}}
    assert errors_of(ppo) == ["algorithm.off_policy: max_staleness > 0 trains on samples of older policies; add "
                              "algorithm.off_policy: {correction: tis} (or mis), or set tis_cap"]
    ok = {**base_config, "algorithm": {**base_config["algorithm"], "off_policy": {"correction": "mis"}}}
    validate_dict({**ok, "rollout": {"max_staleness": 2}})
    lines = errors_of({**ok, "rollout": {"freshness": "latest", "on_update": "abort", "in_flight_updates": True}})
    assert lines == ["rollout.freshness: 'latest' needs rollout.max_staleness >= 1 (0 is the synchronous loop)",
                     "rollout.in_flight_updates: needs rollout.freshness: latest and max_staleness >= 1 (with "
                     "'fixed' every batch is generated by exactly one version)"]
    assert errors_of({**ok, "rollout": {"max_staleness": 1, "on_update": "abort"}}) == [
        "rollout.on_update: only used with rollout.in_flight_updates: true"]
    ds = {**ok, "rollout": {"refill": {"name": "dynamic_sampling"}}}
    assert errors_of(ds) == ["rollout.refill: 'dynamic_sampling' judges the samples of a prompt together, so it "
                             "needs trainer.samples_per_prompt >= 2, got 1"]
    validate_dict({**ds, "trainer": {**ds["trainer"], "samples_per_prompt": 2}})
    assert errors_of({**ok, "rollout": {"refill": {"name": "dynamic_sampling", "max_generated_factr": 3}},
                      "trainer": {**ds["trainer"], "samples_per_prompt": 2}}) == [
        "rollout.refill.max_generated_factr: Extra inputs are not permitted"]
    assert errors_of({**ok, "rollout": {"refill": "top_k"}})[0].startswith(
        "rollout.refill.name: unknown refill policy 'top_k'; valid: dynamic_sampling, none")
    old = errors_of({**ok, "rollout": {"dynamic_sampling": {"enabled": True}}})
    assert len(old) == 1 and "dynamic_sampling is now a refill policy: write refill: {name: dynamic_sampling" in old[0]


def test_an_awake_colocated_generator_must_fit_beside_the_trainer():
    from xrlhf.engines.training import estimate_train_gib

    # W (issue 14): 0.5b preset, bf16, micro-batch 32 x ~320 tokens, a reference on the GPU: ~33 GiB measured
    gib = estimate_train_gib(494_000_000, 2, 32, 320, 1024, 24, 32000, 494_000_000, 4864)
    assert 28 < gib < 36


def test_an_offline_algorithm_refuses_staleness(base_config, tmp_path):
    path = write_jsonl([{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i)} for i in range(8)],
                       tmp_path / "prefs.jsonl")
    cfg = {**base_config, "algorithm": {"name": "dpo", "dataset": str(path), "batch_size": 8},
           "rollout": {"max_staleness": 1}}
    cfg.pop("critic")
    assert errors_of(cfg) == ["rollout.max_staleness: algorithm 'dpo' cannot learn from samples of older "
                              "policies; set 0"]


def test_vllm_awake_beside_the_trainer_needs_no_sleep_and_room(base_config):
    from xrlhf.engines.base import RolloutPlan
    from xrlhf.engines.vllm import VLLMGenerateEngine, VLLMOptions
    from xrlhf.config.schema import RolloutConfig

    opts = VLLMOptions(engine="vllm", gpu_memory_utilization=0.6, sleep_level=1)
    r = RolloutConfig(max_staleness=1)
    lines = VLLMGenerateEngine.rollout_errors(opts, r, RolloutPlan(False, device_gib=79.2, trainer_gib=33.0))
    assert lines[0].startswith("policy.generate.sleep_level: with rollout.max_staleness 1 the co-located vLLM")
    assert lines[1] == ("policy.generate.gpu_memory_utilization: vLLM stays awake with rollout.max_staleness 1: "
                        "0.6 x 79.2 GiB = 47.5 GiB, plus the trainer's ~33.0 GiB (estimated: weights, gradients, Adam "
                        "states, activations, a reference on the GPU) is over 95% of the GPU; set it to 0.53 or less, "
                        "lower policy.train.micro_batch_size, use the split layout (policy.generate.resources), or "
                        "set rollout.max_staleness: 0")
    assert VLLMGenerateEngine.rollout_errors(opts.model_copy(update={"sleep_level": 0, "gpu_memory_utilization": 0.4}),
                                             r, RolloutPlan(False, 79.2, 33.0)) == []
    assert VLLMGenerateEngine.rollout_errors(opts, r, RolloutPlan(True)) == []  # split: its own GPU
    assert VLLMGenerateEngine.rollout_errors(opts, RolloutConfig(), RolloutPlan(False, 79.2, 70.0)) == []
