"""Bad numbers, bad reward functions and bad user code: skipped and counted, or a clear stop in one
line (exit 2, no traceback) before anything is created; logs and report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import yaml

from xrlhf.report import tidy
from xrlhf.validation import validate_dict
from xrlhf.runner import run
from xrlhf.utils.errors import NonFiniteError, UserError

runs_handles = pytest.mark.usefixtures("ray_session")  # the tests that run handles in this process


def rows(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@runs_handles
def test_function_reward_tensorboard_report_and_periodic_eval(base_config, tmp_path):
    base_config["reward"] = {"source": "function", "function": "tests.e2e.reward_fns:length_reward"}
    base_config["trainer"].update(steps=4, eval_every=2)
    summary = run(validate_dict(base_config), tmp_path / "run")
    out = tmp_path / "run"
    steps = [r for r in rows(out) if "reward/mean" in r]
    assert len(steps) == 4 and all(0 <= r["reward/mean"] <= 1 for r in steps)
    assert [r["step"] for r in rows(out) if "eval/reward_mean" in r] == [0, 2, 4]
    assert "eval/reward_mean" in steps[1]  # periodic eval is logged with its step
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    for png in ("reward.png", "kl.png", "losses.png", "throughput.png", "phases.png"):
        assert (out / "plots" / png).stat().st_size > 1000, png
    report = (out / "report.md").read_text()
    assert "![reward](plots/reward.png)" in report and f"| eval_reward_final | {tidy(summary['eval_reward_final'])} |" in report
    (out / "report.md").unlink()
    proc = subprocess.run([sys.executable, "-m", "xrlhf.cli", "report", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0 and (out / "report.md").is_file()


@runs_handles
def test_nan_rewards_skip_steps_then_abort(base_config, tmp_path):
    base_config["reward"] = {"source": "function", "function": "tests.e2e.reward_fns:nan_reward"}
    base_config["trainer"]["steps"] = 10
    base_config["fault_tolerance"] = {"max_bad_steps": 2}
    with pytest.raises(NonFiniteError, match="2 consecutive steps with non-finite rewards"):
        run(validate_dict(base_config), tmp_path / "run")
    skipped = [r for r in rows(tmp_path / "run") if r.get("skipped_step")]
    assert len(skipped) == 1  # the first bad step is skipped and logged, the second aborts
    assert (tmp_path / "run" / "report.md").is_file()  # an aborted run still explains itself


@runs_handles
def test_raising_reward_scores_zero_and_is_counted(base_config, tmp_path):
    base_config["reward"] = {"source": "function", "function": "tests.e2e.reward_fns:flaky_reward"}
    base_config["fault_tolerance"] = {"reward_errors": "zero"}
    run(validate_dict(base_config), tmp_path / "run")
    steps = [r for r in rows(tmp_path / "run") if "reward/mean" in r]
    assert all("reward/errors" in r for r in steps)
    assert sum(r["reward/errors"] for r in steps) > 0


def test_raising_reward_fails_with_one_line(base_config, tmp_path):
    base_config["reward"] = {"source": "function", "function": "tests.e2e.reward_fns:flaky_reward"}
    base_config["trainer"]["steps"] = 1
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(base_config))
    proc = subprocess.run([sys.executable, "-m", "xrlhf.cli", "run", str(path), "--output-dir", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert "reward.function tests.e2e.reward_fns:flaky_reward: raised ValueError" in line
    assert "fault_tolerance.reward_errors: zero" in line


def test_unknown_reward_function_is_a_config_error(base_config):
    base_config["reward"] = {"source": "function", "function": "tests.e2e.reward_fns:nope"}
    with pytest.raises(UserError, match="reward.function: module 'tests.e2e.reward_fns' has no attribute 'nope'"):
        validate_dict(base_config)


@pytest.mark.long  # ~1 minute or more beside a busy core: make test-all (CI) runs it, make test stays under 30 minutes
@runs_handles
def test_wandb_offline(base_config, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    base_config["trainer"]["steps"] = 1
    base_config["logging"] = {"wandb": True, "wandb_mode": "offline", "tensorboard": False}
    run(validate_dict(base_config), tmp_path / "run")
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))


USER_CODE = textwrap.dedent('''
    from xrlhf.envs.base import Prompt
    from xrlhf.envs.episode import Episode, EpisodeEnv, Turn
    from xrlhf.envs.reasoning import ReasoningEnv
    from xrlhf.tools import Tool, ToolResult


    class CtorRaises(ReasoningEnv):
        def __init__(self, config=None, seed=0):
            raise RuntimeError("no data file")


    class PromptsRaise(ReasoningEnv):
        def train_prompts(self, start, n):
            raise ValueError("bad index")


    class _Once(Episode):
        def step(self, action):
            return Turn(reward=1.0, done=True, correct=True)


    class NoDemos(EpisodeEnv):
        def _prompt(self, i):
            return Prompt(text="hi", answer="hi", index=i, messages=({"role": "user", "content": "hi"},))

        def train_prompts(self, start, n):
            return [self._prompt(i) for i in range(start, start + n)]

        def eval_prompts(self):
            return [self._prompt(i) for i in range(4)]

        def start(self, prompt):
            return _Once()


    class StartRaises(NoDemos):
        def start(self, prompt):
            raise KeyError("episode state")


    class BrokenTool(Tool):
        name = "broken"
        description = "cannot be built"

        def __init__(self, config=None):
            raise RuntimeError("no table here")

        def run(self, arguments):
            return ToolResult("")
''')


@pytest.fixture
def user_code(tmp_path, monkeypatch):
    """A module of the user's own envs and tools (and two that cannot be imported), on the path."""
    pkg = tmp_path / "user"
    pkg.mkdir(mode=0o755)
    (pkg / "user_envs.py").write_text(USER_CODE)
    (pkg / "user_syntax.py").write_text("def f(:\n    pass\n")
    (pkg / "user_raises.py").write_text("import os\nTABLE = os.environ['NO_SUCH_VARIABLE_XRLHF']\n")
    monkeypatch.syspath_prepend(str(pkg))
    yield pkg
    for m in ("user_envs", "user_syntax", "user_raises"):
        sys.modules.pop(m, None)


CASES = {
    "syntax error": ({"env": {"name": "user_syntax:Env"}},
                     "env.name: cannot import module 'user_syntax' of 'user_syntax:Env': SyntaxError: invalid syntax ("),
    "import raises": ({"env": {"name": "user_raises:Env"}},
                      "env.name: cannot import module 'user_raises' of 'user_raises:Env': importing it raised KeyError: "
                      "'NO_SUCH_VARIABLE_XRLHF'; fix the module"),
    "constructor": ({"env": {"name": "user_envs:CtorRaises"}},
                    "env.name: env 'user_envs:CtorRaises' could not be built: RuntimeError: no data file; fix its "
                    "constructor (__init__)"),
    "prompts": ({"env": {"name": "user_envs:PromptsRaise"}},
                "env.name: env 'user_envs:PromptsRaise': train_prompts(0, 4) raised ValueError: bad index; fix the env"),
    "start": ({"env": {"name": "user_envs:StartRaises"}},
              "env.name: env 'user_envs:StartRaises': start() of prompt 'hi' raised KeyError: 'episode state'; fix the "
              "env's start (it begins every episode)"),
    "no demonstrations": ({"env": {"name": "user_envs:NoDemos"}, "warmup": {"steps": 2}},
                          "warmup.steps: 2 warm-up steps, but NoDemos has no demonstrations for a warm-up; set "
                          "warmup.steps: 0 or override sft_conversations()"),
    "tool constructor": ({"env": {"name": "calc", "options": {"tools": [{"name": "user_envs:BrokenTool"}]}}},
                         "env.options.tools[0]: tool 'broken' could not start in its sandbox: RuntimeError: no table "
                         "here"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_user_code_failing_at_start_is_one_line(base_config, user_code, case):
    sections, line = CASES[case]
    with pytest.raises(UserError) as e:
        validate_dict({**base_config, **sections})
    assert len(e.value.messages) == 1 and e.value.messages[0].startswith(line), e.value.messages


def test_cli_user_code_error_exits_2_in_one_line_before_the_run_directory(base_config, user_code, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**base_config, "env": {"name": "user_envs:NoDemos"}, "warmup": {"steps": 2}}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(user_code), os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "xrlhf.cli", "run", str(path), "--output-dir", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert line.startswith("error: warmup.steps: 2 warm-up steps, but NoDemos has no demonstrations")
    assert not (tmp_path / "o").exists()
