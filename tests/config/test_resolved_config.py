"""A run's config.yaml is the resolved config (the algorithm's, the env's and the engines' options
with their defaults), and --resume compares resolved values: a default given explicitly is the
same run, a changed value is refused in one line."""

from __future__ import annotations

import copy

import pytest
import yaml

from xrlhf.config import dump_config
from xrlhf.rundir import RESUME, check_output_dir
from xrlhf.utils.errors import UserError
from xrlhf.resolved import resolve_dict, resolved_config
from xrlhf.validation import validate_dict


def test_config_yaml_holds_every_default(base_config):
    data = resolved_config(validate_dict(base_config))
    assert data["algorithm"]["name"] == "ppo" and data["algorithm"]["clip_eps"] == 0.2  # not in the YAML
    assert data["algorithm"]["mini_batch_size"] == 8 and data["algorithm"]["value_clip_eps"] == 0.2
    assert data["env"]["options"]["eval_size"] == 16 and data["env"]["options"]["sort_length"] == 3
    assert data["policy"]["train"]["packing"] == "auto" and data["policy"]["generate"]["max_new_tokens"] == 4
    assert "logprob_chunk_tokens" in data["reference"]["infer"]
    assert resolve_dict(yaml.safe_load(dump_config(data))) == data  # resolving what config.yaml holds changes nothing


def started_run(tmp_path, data: dict) -> None:
    """A run directory with ``config.yaml`` and a checkpoint (what ``--resume`` compares against)."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(data)
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000001"
    ckpt.mkdir(parents=True)
    (ckpt / "manifest.json").write_text('{"step": 1, "files": {}}')


def test_resume_accepts_a_default_given_explicitly_and_refuses_a_change(base_config, tmp_path):
    started_run(tmp_path, dump_config(resolved_config(validate_dict(base_config))))
    explicit = copy.deepcopy(base_config)
    explicit["algorithm"]["clip_eps"] = 0.2
    explicit["policy"]["train"]["packing"] = "auto"
    explicit["env"]["options"]["sort_length"] = 3  # the reasoning env's default
    assert check_output_dir(tmp_path / "run", validate_dict(explicit), resume=True) == RESUME  # the same run
    explicit["algorithm"]["clip_eps"] = 0.3
    with pytest.raises(UserError) as e:
        check_output_dir(tmp_path / "run", validate_dict(explicit), resume=True)
    assert e.value.messages == ["--resume: algorithm.clip_eps differs from the original run (0.2 there, 0.3 now)"]


def test_resume_of_a_run_whose_config_yaml_was_written_unresolved(base_config, tmp_path):
    """A run started before config.yaml was resolved: its sections are resolved when compared."""
    started_run(tmp_path, dump_config(validate_dict(base_config)))
    explicit = copy.deepcopy(base_config)
    explicit["algorithm"]["clip_eps"] = 0.2
    assert check_output_dir(tmp_path / "run", validate_dict(explicit), resume=True) == RESUME
