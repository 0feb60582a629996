"""benchmarks/learning_cpu.py's command line: each suite keeps the options, defaults and JSON names
of the script it replaced (issue 52), so the commands in docs/ reproduce their figures; the
report writes a command recorded before the merge in today's form. Nothing here trains."""

from __future__ import annotations

import pytest

from benchmarks import learning_cpu
from benchmarks.common import ROOT
from benchmarks.report.learning import current_command


def test_each_suite_keeps_its_defaults():
    a = learning_cpu.parse_args(["async"])
    assert a.configs == ["configs/grpo.yaml", "configs/quickstart.yaml"] and a.seeds == [0, 1, 2]
    assert a.mode_list == ["sync", "async"] and a.out == "benchmarks/results" and not a.gpu and a.lr == 2e-5
    assert a.warmup_lr == 2e-4 and a.eval_every == 5 and a.steps is None and a.runs_dir is None
    e = learning_cpu.parse_args(["episodes", "--runs", "tool_calc", "--steps", "2", "x.y=1"])
    assert e.runs == ["tool_calc"] and e.seeds == [0] and e.steps == 2 and e.overrides == ["x.y=1"]
    assert learning_cpu.parse_args(["episodes"]).runs == ["tool_calc", "tool_calc_no_tool", "multiturn_qa"]
    d = learning_cpu.parse_args(["distill", "--name", "topk32", "algorithm.topk_coef=1.0"])
    assert d.name == "topk32" and d.seeds == [0, 1, 2] and d.overrides == ["algorithm.topk_coef=1.0"]
    s = learning_cpu.parse_args(["seeds", "--configs", "quickstart", "--set", "trainer.steps=5"])
    assert s.configs == ["quickstart"] and s.set == ["trainer.steps=5"] and s.seeds == [0, 1, 2]
    assert learning_cpu.parse_args(["seeds"]).out == ROOT / "benchmarks" / "results" / "learning_seeds.json"
    assert learning_cpu.parse_args(["seeds"]).configs == learning_cpu.SEED_CONFIGS
    assert learning_cpu.command(s) == ("python -m benchmarks.learning_cpu seeds --configs quickstart "
                                       "--set trainer.steps=5")


@pytest.mark.parametrize("argv", [[], ["nope"], ["async", "--modes", "both"], ["episodes", "--runs", "x"]])
def test_a_bad_command_line_exits(argv):
    with pytest.raises(SystemExit):
        learning_cpu.parse_args(argv)


def test_recorded_commands_in_todays_form():
    assert (current_command("python benchmarks/async_learning.py --seeds 0 --out /tmp/a")
            == "python -m benchmarks.learning_cpu async --seeds 0 --out /tmp/a")
    assert (current_command("python /w/benchmarks/distill_learning.py --name topk32")
            == "python -m benchmarks.learning_cpu distill --name topk32")
    assert current_command("python -m benchmarks.episodes_learning --runs multiturn_qa") == (
        "python -m benchmarks.learning_cpu episodes --runs multiturn_qa")
    assert current_command("seeds 0-2 (benchmarks/learning_seeds.py --set ...)") == (
        "seeds 0-2 (benchmarks/learning_cpu.py seeds --set ...)")
    kept = "`benchmarks/results/learning_seeds.json`, async_learning_cpu.json"
    assert current_command(kept) == kept


def test_merged_benchmarks_commands_in_todays_form():
    """The scripts merged into another's command (issue 52): a recorded command runs as that command."""
    assert current_command("python /work/main/benchmarks/ppo_step_bench.py --verify --out /o") == (
        "python -m benchmarks.train_step ppo --verify --out /o")
    assert current_command("python -m benchmarks.vllm_overhead --engines-per-gpu 1 2") == (
        "python -m benchmarks.generation overhead --engines-per-gpu 1 2")
    assert current_command("python -m benchmarks.train_efficiency --matrix") == "python -m benchmarks.train_step --matrix"
    assert current_command("python -m benchmarks.healing --gpu; benchmarks.healing.gpu_config(gpus=2)") == (
        "python -m benchmarks.recovery heal --gpu; benchmarks.recovery.healing.gpu_config(gpus=2)")
    assert current_command("`make chaos` (benchmarks/chaos.py)") == "`make chaos` (benchmarks/recovery/chaos.py)"
    assert current_command("python benchmarks/episodes_gpu.py --mode sync") == (
        "python -m benchmarks.async_grpo episodes --mode sync")
    kept = "vllm_overhead.json, episodes_gpu_sync.json, tests/e2e/test_healing.py"
    assert current_command(kept) == kept
