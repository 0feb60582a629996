"""Config loading: every problem reported at once, named by its YAML path, before anything starts."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import yaml

from xrlhf.validation import load_config, validate_dict
from xrlhf.config.loader import apply_overrides
from xrlhf.utils.errors import UserError


def errors_of(data: dict) -> list[str]:
    with pytest.raises(UserError) as e:
        validate_dict(data)
    return e.value.messages


def test_valid_config_loads(base_config):
    cfg = validate_dict(base_config)
    assert cfg.policy.resources.ranks == 2
    assert cfg.algorithm.name == "ppo"


def test_unknown_key_lists_valid_keys(base_config):
    base_config["policy"]["train"]["learning_rate"] = 1e-3
    (line,) = errors_of(base_config)
    assert line.startswith("policy.train.learning_rate: unknown key (valid: ")
    assert "lr" in line and "micro_batch_size" in line


def test_wrong_type_and_range(base_config):
    base_config["policy"]["train"]["micro_batch_size"] = 0
    base_config["trainer"]["steps"] = "many"
    lines = errors_of(base_config)
    assert "policy.train.micro_batch_size: must be >= 1, got 0" in lines
    assert any(line.startswith("trainer.steps: ") and "'many'" in line for line in lines)


def test_missing_model_path_is_named(base_config, tmp_path):
    base_config["policy"]["model"] = str(tmp_path / "nope")
    (line,) = errors_of(base_config)
    assert line.startswith("policy.model: no such model directory")
    assert "make-tiny-model" in line


def test_several_errors_at_once(base_config, tmp_path):
    base_config["policy"]["model"] = str(tmp_path / "nope")
    base_config["policy"]["generate"]["top_p"] = 1.5
    base_config["critic"]["bogus"] = 1
    base_config["algorithm"]["kl_coeff"] = 0.1
    base_config["env"]["options"]["max_operand"] = -3
    lines = errors_of(base_config)
    joined = "\n".join(lines)
    assert "policy.model:" in joined
    assert "policy.generate.top_p: must be <= 1, got 1.5" in lines
    assert any(line.startswith("critic.bogus: unknown key") for line in lines)
    # options of registered classes are checked too, with their own valid keys
    assert any(line.startswith("algorithm.kl_coeff: unknown key") and "kl_coef" in line for line in lines)
    assert any(line.startswith("env.options.max_operand: must be >= 1") for line in lines)


def test_algorithm_and_env_names(base_config):
    base_config["algorithm"]["name"] = "nope"
    base_config["env"]["name"] = "nada"
    lines = errors_of(base_config)
    assert any(line.startswith("algorithm.name: unknown algorithm 'nope'; valid: ") and "ppo" in line
               for line in lines)
    assert any(line.startswith("env.name: unknown env 'nada'; valid: ") for line in lines)


def test_cross_field_checks(base_config):
    base_config["algorithm"]["mini_batch_size"] = 5
    del base_config["critic"]
    lines = errors_of(base_config)
    assert any(line.startswith("algorithm.mini_batch_size: 5 must divide the rollout batch") for line in lines)
    assert any(line.startswith("critic: algorithm 'ppo' needs a critic section") for line in lines)


def test_overrides_typed_and_nested():
    data = {"algorithm": {"name": "ppo"}}
    apply_overrides(data, ["algorithm.kl_coef=0.05", "policy.train.lr=1e-5", "trainer.save_final=false"])
    assert data["algorithm"]["kl_coef"] == 0.05
    assert data["policy"]["train"]["lr"] == 1e-5
    assert data["trainer"]["save_final"] is False
    with pytest.raises(UserError, match="must look like section.key=value"):
        apply_overrides(data, ["justakey"])


def test_overrides_index_lists():
    data = {"env": {"options": {"tools": [{"name": "calculator", "options": {"timeout_s": 5}}, {"name": "python"}]}}}
    apply_overrides(data, ["env.options.tools[0].options.timeout_s=2", "env.options.tools[1].options.sandbox=process"])
    assert data["env"]["options"]["tools"] == [{"name": "calculator", "options": {"timeout_s": 2}},
                                               {"name": "python", "options": {"sandbox": "process"}}]
    with pytest.raises(UserError) as e:
        apply_overrides(data, ["env.options.tools[2].name=x", "env.options[0].x=1", "env.options.tools[x]=1",
                               "nothing[0]=1"])
    assert e.value.messages == [
        "env.options.tools[2].name: index 2 is out of range; the list holds 2 item(s)",
        "env.options[0].x: 'options' is not a list (it holds {'tools': [{'name': 'calculator', 'options': "
        "{'timeout_s': 2}}, {'name': 'python', 'options': {'sandbox': 'process'}}]})",
        "env.options.tools[x]=1: an override must look like section.key=value (a list item: key[0])",
        "nothing[0]: 'nothing' holds no list to index"]


def test_load_config_from_file(base_config, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(base_config))
    cfg = load_config(path, ["algorithm.kl_coef=0.2"])
    assert cfg.algorithm.options()["kl_coef"] == 0.2
    with pytest.raises(UserError, match=r"c.yaml:\d+: not valid YAML"):
        (tmp_path / "c.yaml").write_text("a: [1, 2\n")
        load_config(path)


def test_cli_exit_2_without_traceback_and_before_ray(base_config, tmp_path):
    base_config["policy"]["train"]["micro_batch_size"] = 0
    base_config["trainer"]["bogus"] = True
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(base_config))
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "xrlhf.cli", "run", str(path), "--output-dir", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert "error: policy.train.micro_batch_size: must be >= 1, got 0" in lines
    assert any(line.startswith("error: trainer.bogus: unknown key") for line in lines)
    assert not (tmp_path / "o").exists(), "nothing may start (or be written) for a bad config"
    assert time.time() - t0 < 60


def test_cli_validate_ok(base_config, tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text(yaml.safe_dump(base_config))
    proc = subprocess.run([sys.executable, "-m", "xrlhf.cli", "validate", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "ok" in proc.stdout


def test_shipped_configs_validate(tiny_model):
    import glob

    for path in sorted(glob.glob("configs/*.yaml")):
        data = yaml.safe_load(open(path))
        if "dataset" in data.get("algorithm", {}) or "dataset" in data.get("env", {}).get("options", {}):
            continue  # configs reading generated datasets run end to end in tests/e2e/test_configs_algos.py
        data["policy"]["model"] = tiny_model  # configs name a model built by the Makefile
        for section in ("reward", "teacher"):
            if isinstance(data.get(section), dict) and data[section].get("model"):
                data[section]["model"] = tiny_model
        validate_dict(data)


def test_cli_help_lists_every_command_without_importing_torch():
    # each command's own arguments come from its module, imported only when that command runs
    code = ("import contextlib, io, sys\nfrom xrlhf.cli import main\nout = io.StringIO()\n"
            "with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n    main(['--help'])\n"
            "print(out.getvalue())\nprint('torch imported:', 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for command in ("run", "validate", "report", "plan", "make-tiny-model", "make-dataset", "prepare-data",
                    "make-completions"):
        assert command in proc.stdout
    assert "torch imported: False" in proc.stdout


@pytest.mark.parametrize("command, option", [("make-tiny-model", "--preset"), ("plan", "--gpus"),
                                             ("make-dataset", "--rows"), ("prepare-data", "--root"),
                                             ("make-completions", "--count")])
@pytest.mark.usefixtures("restore_environ")
def test_cli_command_help_has_its_own_options(command, option, capsys):
    from xrlhf.cli import main

    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0 and option in capsys.readouterr().out
