"""Every way of using the GPUs (``plan.search``), the step-time model (``plan.speed``) and
``layout: auto`` (``plan.auto``): CPU only, models from ``configs/shapes`` (no weights)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from xrlhf.cli import main
from xrlhf.plan.auto import apply_auto_layout
from xrlhf.plan.cli import read_for_plan
from xrlhf.plan.layouts import Cluster
from xrlhf.plan.search import search
from xrlhf.plan.speed import GPU_KINDS, speeds_for
from xrlhf.utils.errors import UserError

ROOT = Path(__file__).parents[2]
W = str(ROOT / "configs" / "gpu" / "grpo_w.yaml")
W7 = str(ROOT / "configs" / "gpu" / "grpo_w7.yaml")
SHAPES = ROOT / "configs" / "shapes"
H200 = speeds_for(GPU_KINDS["h200"])
FOUR_H200 = Cluster(4, 1, 141)
W_7B = [f"policy.model={SHAPES / 'qwen2.5-7b'}", "policy.generate.max_new_tokens=512",
        "policy.generate.max_model_len=640"]
pytestmark = pytest.mark.usefixtures("restore_environ")  # main() runs in this process


def _w7(*overrides: str) -> dict:
    return read_for_plan(W7, [f"policy.model={SHAPES / 'model-7b'}", *overrides])


def test_7b_on_four_h200_shards_the_trainer_and_ranks_colocated_and_split(capsys):
    """Issue 50: W with Qwen2.5-7B fit no 1- or 2-GPU layout; on 4 GPUs ZeRO-3 over 2-4 ranks
    fits, co-located and split, ranked by planned step time."""
    options = search(read_for_plan(W, W_7B), FOUR_H200, H200)
    fits = [o for o in options if o.fits]
    assert {o.placement.split for o in fits} == {False, True}
    for o in options:  # every layout uses the 4 GPUs
        p = o.placement
        assert p.trainers + (p.dp * p.tp if p.split else 0) == 4
    for o in fits:
        t = o.plan.inp.get("policy").trainer
        assert (t.engine, t.zero_stage, t.ranks) == ("deepspeed", 3, o.placement.trainers) and t.ranks > 1
        assert o.overrides["ray.num_gpus"] == 4 and o.overrides["reference.resources.ranks"] == t.ranks
    assert [o.time.total for o in fits] == sorted(o.time.total for o in fits)
    assert any(o.placement.tp == 2 for o in fits)  # vLLM tensor parallel: 2 trainers + 1 generator of 2 GPUs
    alone = next(o for o in options if o.placement.trainers == 1)
    assert not alone.fits and "policy holds" in alone.problem  # one unsharded rank: 18 bytes x 7.6B

    rc = main(["plan", W, *W_7B, "--gpus", "4", "--gpu-memory", "141"])
    out = capsys.readouterr().out
    assert rc == 2  # the configured layout (one GPU) still does not fit
    assert "## every way of using 4 GPU(s), fastest first" in out
    assert "| 1 | split, one step off | 3 x ZeRO-3 | 1 x tp 1 | " in out
    assert "| co-located, sync | 4 x ZeRO-3 | 4 x tp 1 | " in out
    assert "\nfastest: xrlhf run " in out and "policy.train.zero_stage=3" in out


def test_a_lower_gpu_memory_utilization_is_named_when_it_makes_a_layout_fit(capsys):
    """Issue 49: vLLM's share (0.9 of the GPU, its KV cache sized by it) leaves the trainer too
    little; the plan names the largest share that fits, as the fix and in the ranking."""
    args = ["plan", W, f"policy.model={SHAPES / 'model-0.5b'}", "policy.generate.kv_cache_tokens=null",
            "policy.generate.gpu_memory_utilization=0.9", "--gpus", "2", "--gpu-memory", "79.2"]
    assert main(args) == 2
    out = capsys.readouterr().out
    assert "rollout holds 71.5 GiB" in out  # 0.9 x 79.2 GiB
    assert "\nfix: policy.generate.gpu_memory_utilization=0.75 (fits" in out
    assert "fits with policy.generate.gpu_memory_utilization=0.75 (configured 0.9)" in out
    assert main(args + ["--apply"]) == 0
    assert "policy.generate.gpu_memory_utilization=0.75" in capsys.readouterr().out.split()


def test_gpus_beyond_the_configured_layout_are_used(capsys):
    """Issue 49: W asks for one GPU; on four, every layout weighed uses all four (more trainer
    ranks, more generators), and the fastest is not W's one-GPU layout."""
    options = search(read_for_plan(W, [f"policy.model={SHAPES / 'model-0.5b'}"]), Cluster(4, 1, 79.2),
                     speeds_for(GPU_KINDS["h100"]))
    shapes = {(o.placement.split, o.placement.trainers, o.placement.dp, o.placement.tp) for o in options}
    assert shapes == {(False, 4, 4, 1), (True, 3, 1, 1), (True, 2, 2, 1), (True, 1, 3, 1), (True, 2, 1, 2)}
    assert all(o.fits for o in options)  # 0.5B fits anywhere: the ranking decides
    colocated = next(o for o in options if not o.placement.split and not o.placement.staleness)
    assert colocated.plan.inp.get("policy").trainer.engine == "hf"  # fits unsharded: no ZeRO-3 needed
    one_gpu = search(read_for_plan(W, [f"policy.model={SHAPES / 'model-0.5b'}"]), Cluster(1, 1, 79.2),
                     speeds_for(GPU_KINDS["h100"]))
    assert options[0].time.total < one_gpu[0].time.total


def test_layout_auto_applies_the_fastest_and_keeps_what_the_config_sets():
    data = _w7()
    chosen = apply_auto_layout(data, FOUR_H200, H200)
    assert data["policy"]["resources"] == {"cpus_per_rank": 3, "gpus_per_rank": 1}  # the input is not changed
    assert chosen["policy"]["resources"]["ranks"] == 3 and chosen["policy"]["train"]["zero_stage"] == 3
    assert chosen["policy"]["generate"]["resources"]["ranks"] == 1 and chosen["rollout"]["max_staleness"] == 1
    assert chosen["policy"]["generate"]["gpu_memory_utilization"] == 0.3  # written: kept

    kept = apply_auto_layout(_w7("policy.resources.ranks=2"), FOUR_H200, H200)
    assert kept["policy"]["resources"]["ranks"] == 2 and kept["policy"]["generate"]["resources"]["ranks"] == 2
    sync = apply_auto_layout(_w7("rollout.max_staleness=0"), FOUR_H200, H200)
    assert sync["policy"]["generate"]["resources"] is None and sync["policy"]["resources"]["ranks"] == 4
    assert sync["policy"]["generate"]["sleep_level"] == 2
    with pytest.raises(UserError, match=r"layout: auto: no layout fits 4 GPU\(s\) of 141 GiB: the closest: "):
        apply_auto_layout(_w7("policy.resources.ranks=1", "policy.train.engine=hf"), FOUR_H200, H200)


def test_layout_auto_without_a_gpu_validates_the_layout_as_written(monkeypatch):
    from xrlhf.plan import machine

    monkeypatch.setattr(machine, "gpu_total_gib", lambda: None)
    data = _w7()
    assert apply_auto_layout(data) is data


def test_validate_applies_layout_auto_first(base_config, monkeypatch):
    import xrlhf.validation as v
    from xrlhf.plan import auto

    seen = []

    def chosen(data):
        seen.append(data["layout"])
        return {**data, "trainer": {**data["trainer"], "steps": 3}}

    monkeypatch.setattr(auto, "apply_auto_layout", chosen)
    assert v.validate_dict({**base_config, "layout": "auto"}).trainer.steps == 3 and seen == ["auto"]
    assert v.validate_dict(base_config).trainer.steps == 2 and seen == ["auto"]  # no layout: auto, no search


def test_w7_plans_on_this_cpu_machine(capsys):
    args = ["plan", W7, f"policy.model={SHAPES / 'model-7b'}", "--gpus", "4", "--gpu-memory", "141"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "## split (1 generator GPUs), async (layout: auto's choice, below): fits" in out
    assert "\nlayout: auto: #1, policy.resources.ranks=3 " in out
    assert main(args + ["--apply", "--speed", "decode_mfu=0.25"]) == 0  # decoding slower: all 4 GPUs generate
    assert {"policy.resources.ranks=4", "policy.generate.resources=null"} <= set(capsys.readouterr().out.split())
    assert main(args + ["--speed", "warp=2"]) == 2
    assert "error: --speed warp=2: unknown constant 'warp'" in capsys.readouterr().err


@pytest.mark.parametrize("config, model, measured", [
    # one H200, the twelfth session of 2026-11-28 (docs/benchmarks.md): s/step, generate, infer, train
    ("grpo_w.yaml", "model-0.5b", (4.07, 2.58, 0.30, 0.83)),
    ("grpo_w2.yaml", "model-1.5b", (7.44, 4.46, 0.66, 1.87)),
])
def test_step_time_model_against_w_and_w2_on_one_h200(config, model, measured):
    from xrlhf.plan.cli import validated
    from xrlhf.plan.inputs import plan_input
    from xrlhf.plan.layouts import configured_layout, plan_layout
    from xrlhf.plan.search import plan_time

    inp = plan_input(validated(read_for_plan(str(ROOT / "configs" / "gpu" / config),
                                             [f"policy.model={SHAPES / model}"])), prompt_tokens=32)
    cluster = Cluster(1, 1, 139.8)
    t = plan_time(plan_layout(inp, configured_layout(inp), cluster), cluster, H200)
    for planned, real, bound in zip((t.total, t.generate, t.infer, t.train), measured, (0.15, 0.3, 0.3, 0.3)):
        assert abs(planned / real - 1) < bound, (planned, real)


def test_the_7b_preset_is_qwen2_5_7b_s_shape_with_the_presets_vocabulary():
    from xrlhf.models.tiny import PRESETS, llama_config, preset_config, preset_params
    from xrlhf.plan.shapes import model_shape

    qwen = json.loads((SHAPES / "qwen2.5-7b" / "config.json").read_text())
    ours = preset_config("7b")
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "tie_word_embeddings"):
        assert getattr(ours, key) == qwen[key], key
    assert ours.vocab_size == 32000 and not ours.tie_word_embeddings  # Qwen unties; the other presets tie
    shipped = json.loads((SHAPES / "model-7b" / "config.json").read_text())
    assert all(getattr(ours, k) == v for k, v in shipped.items() if k != "architectures")

    class Tok:  # what build_model's config reads of its BPE tokenizer: 32,000 tokens, ids 0-2 special
        pad_token_id, bos_token_id, eos_token_id = 0, 1, 2

        def __len__(self):
            return 32000

    spec = {k: v for k, v in PRESETS["7b"].items() if k not in ("tokenizer", "vocab_size")}
    built = llama_config(Tok(), **spec)  # the config build_model saves, without its 13.5 GB of weights
    assert built.to_dict() == ours.to_dict()
    layer = 2 * 3584**2 + 2 * 3584 * 512 + 3 * 3584 * 18944 + 2 * 3584
    assert preset_params("7b") == 28 * layer + 2 * 32000 * 3584 + 3584 == 6_754_868_736
    assert model_shape(str(SHAPES / "model-7b")).params == 6_754_868_736
