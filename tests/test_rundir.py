"""The run directory (issue 49): one writer at a time (a flock naming the live run), every path
problem one line and exit 2, a run that saved nothing started again in place, a finished run
extended or the new run from its final/ named; checkpoints by time as well as steps; metrics
cut only under the lock and written whole."""

from __future__ import annotations

import errno
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from xrlhf.checkpoint import SaveSchedule
from xrlhf.config import dump_config
from xrlhf.config.schema import CheckpointConfig, LoggingConfig
from xrlhf.resolved import resolved_config
from xrlhf.rundir import (AGAIN, EXTEND, NEW, RESUME, NewRunNeeded, RunLock, begin_attempt, check_output_dir,
                          make_output_dir)
from xrlhf.tracking import Tracker
from xrlhf.utils.errors import UserError
from xrlhf.utils.files import atomic_write
from xrlhf.validation import validate_dict


# -- the path ---------------------------------------------------------------------------------
@pytest.mark.parametrize("where, says", [
    ("/proc/xrlhf-run", "lies under /proc, a virtual file system"),
    ("/sys/xrlhf-run", "lies under /sys, a virtual file system"),
    ("{tmp}/a-file", "is a file, not a directory"),
    ("{tmp}/a-file/run", "lies under {tmp}/a-file, which is a file, not a directory"),
])
def test_a_path_that_cannot_be_a_run_directory_is_one_line(tmp_path, where, says):
    (tmp_path / "a-file").write_text("x")
    out = Path(where.format(tmp=tmp_path))
    with pytest.raises(UserError) as e:
        make_output_dir(out)
    (line,) = e.value.messages
    assert line.startswith(f"--output-dir: {out} ") and says.format(tmp=tmp_path) in line
    assert "choose" in line  # the fix


def test_a_directory_that_cannot_be_created_or_written_is_one_line(tmp_path, monkeypatch):
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(UserError) as e:
        make_output_dir(tmp_path / "new")
    assert e.value.messages == [f"--output-dir: cannot create {tmp_path / 'new'} (Read-only file system); choose a "
                                f"directory you can write to"]
    monkeypatch.undo()
    monkeypatch.setattr("xrlhf.rundir.os.open", read_only)  # the lock file is the first thing written there
    with pytest.raises(UserError) as e:
        RunLock(tmp_path).acquire()
    assert e.value.messages == [f"--output-dir: {tmp_path} is not writable (Read-only file system); choose a "
                                f"directory you can write to"]


def test_resume_of_a_directory_that_does_not_exist_creates_nothing(tmp_path):
    with pytest.raises(UserError, match=r"^--resume: .*/typo does not exist; check --output-dir"):
        make_output_dir(tmp_path / "typo", resume=True)
    assert not (tmp_path / "typo").exists()


def test_the_cli_refuses_a_bad_output_dir_in_one_line_exit_2(base_config, tmp_path, capsys, restore_environ):
    from xrlhf.cli import main

    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(base_config))
    assert main(["run", str(tmp_path / "cfg.yaml"), "--output-dir", "/proc/xrlhf-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --output-dir: /proc/xrlhf-run lies under /proc, a virtual file system of the kernel that "
                   "keeps no files; choose a directory on a disk"]


# -- the lock ---------------------------------------------------------------------------------
def test_a_second_writer_is_refused_naming_the_live_one(tmp_path):
    import os

    with RunLock(tmp_path) as lock:
        record = json.loads((tmp_path / "run.lock").read_text())
        assert lock.held and record["pid"] == os.getpid() and record["started"]
        with pytest.raises(UserError) as e:
            RunLock(tmp_path).acquire()  # flock is per open file: a second open in this process is refused too
        (line,) = e.value.messages
        assert line == (f"--output-dir: {tmp_path} is being written by a live run (pid {os.getpid()} on "
                        f"{record['host']}, started {record['started']}); wait for it to end or stop it "
                        f"(kill -INT {os.getpid()}), or choose another --output-dir")
    assert (tmp_path / "run.lock").read_text() == ""  # a clean end empties the record
    with RunLock(tmp_path):
        pass


@pytest.fixture()
def logged():
    """The messages loguru logs during the test."""
    from loguru import logger

    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(m.record["message"]), level="INFO")
    yield lines
    logger.remove(sink)


def test_the_lock_of_a_dead_run_is_taken_over(tmp_path, logged):
    code = (f"from pathlib import Path; from xrlhf.rundir import RunLock; RunLock(Path({str(tmp_path)!r})).acquire(); "
            f"print('held', flush=True); import time; time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match=rf"live run \(pid {proc.pid} on .*kill -INT {proc.pid}\)"):
            RunLock(tmp_path).acquire()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with RunLock(tmp_path):  # the kernel dropped the dead process's flock
        pass
    assert any(f"taking over from pid {proc.pid}" in m for m in logged)


def test_metrics_are_cut_only_under_the_lock_and_whole(tmp_path):
    lock = RunLock(tmp_path)
    tracker = Tracker(tmp_path, LoggingConfig(tensorboard=False), "t", {}, lock=lock)
    tracker({"step": 1, "x": 1.0})
    offset = tracker.offset()
    tracker({"step": 2, "x": 2.0})
    with pytest.raises(RuntimeError, match="lock"):
        tracker.truncate(offset)
    with lock:
        tracker.truncate(offset)
        tracker({"step": 2, "x": 3.0})  # the resumed run writes its step again, after the cut
    tracker.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "x": 1.0}, {"step": 2, "x": 3.0}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "run.lock"]  # no temporary left


def test_atomic_write_replaces_whole(tmp_path):
    atomic_write(tmp_path / "f.json", "old")
    atomic_write(tmp_path / "f.json", b"new")
    assert (tmp_path / "f.json").read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["f.json"]


# -- when to save -----------------------------------------------------------------------------
def test_checkpoints_by_steps_or_minutes_whichever_comes_first():
    now = [0.0]
    saves = SaveSchedule(every=5, every_minutes=10, clock=lambda: now[0])
    assert not saves.due(1)
    now[0] = 599.0
    assert not saves.due(2) and saves.due(5)  # steps first
    saves.saved()
    now[0] = 599.0 + 600
    assert saves.due(6)  # then time
    saves.saved()
    assert not saves.due(7)
    off = SaveSchedule(every=0, every_minutes=0, clock=lambda: now[0])
    now[0] = 1e9
    assert not off.due(10)
    assert saves.on and not off.on  # off: not even the last step is saved (a signal still is)


def test_checkpoints_are_on_by_default_every_ten_minutes(base_config):
    cfg = validate_dict(base_config)
    assert cfg.checkpoint.every == 0 and cfg.checkpoint.every_minutes == 10 and cfg.checkpoint.keep == 2
    base_config["checkpoint"] = {"every": 50}  # a step cadence (the quickstart's) and the time trigger both
    assert validate_dict(base_config).checkpoint.every_minutes == 10
    base_config["checkpoint"] = {"every": 50, "every_minutes": 5}
    data = resolved_config(validate_dict(base_config))
    assert data["checkpoint"] == {"every": 50, "every_minutes": 5, "keep": 2}  # config.yaml says it as it runs
    base_config["checkpoint"] = {"every": 50}
    data = resolved_config(validate_dict(base_config))  # every_minutes: 10 in config.yaml, so read back the same
    assert CheckpointConfig.model_validate(data["checkpoint"]) == validate_dict(base_config).checkpoint


# -- what the directory holds -----------------------------------------------------------------
def started(out: Path, config: dict, checkpoints: tuple[int, ...] = (), finished: bool = False) -> Path:
    """A run directory as a run of ``config`` leaves it: its checkpoints (manifests only), and when
    ``finished`` its summary and ``final/``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(dump_config(resolved_config(validate_dict(config))))
    for step in checkpoints:
        ckpt = out / "checkpoints" / f"step-{step:08d}"
        ckpt.mkdir(parents=True)
        (ckpt / "manifest.json").write_text(json.dumps({"step": step, "files": {}}))
    if finished:
        (out / "summary.json").write_text("{}")
        (out / "final").mkdir()
        (out / "final" / "config.json").write_text("{}")
    return out


def test_a_run_that_saved_nothing_starts_again_with_or_without_resume(base_config, tmp_path, logged):
    cfg = validate_dict(base_config)
    assert check_output_dir(tmp_path / "empty", cfg, resume=False) == NEW
    with pytest.raises(UserError, match=r"--resume: .*/empty holds no run \(no config.yaml\)"):
        check_output_dir(tmp_path / "empty", cfg, resume=True)
    out = started(tmp_path / "r", base_config)  # killed in its start-up, or before its first checkpoint
    (out / "tensorboard").mkdir()
    assert check_output_dir(out, cfg, resume=False) == AGAIN
    assert check_output_dir(out, cfg, resume=True) == AGAIN
    assert logged == [f"{out} holds a run that saved nothing (it stopped before its first checkpoint); starting it "
                      f"again there", f"--resume: {out} has no checkpoint (the run stopped before its first one); "
                      f"starting it from scratch"]
    base_config["algorithm"]["kl_coef"] = 0.5  # nothing saved: nothing a changed config could mismatch
    assert check_output_dir(out, validate_dict(base_config), resume=True) == AGAIN
    begin_attempt(out, AGAIN)
    assert not (out / "tensorboard").exists()  # the events of the steps redone from scratch


def test_a_run_with_checkpoints_is_continued_by_resume_only(base_config, tmp_path):
    cfg = validate_dict(base_config)
    out = started(tmp_path / "r", base_config, checkpoints=(1,))
    with pytest.raises(UserError, match=r"already holds a run; choose another directory, or add --resume"):
        check_output_dir(out, cfg, resume=False)
    assert check_output_dir(out, cfg, resume=True) == RESUME
    base_config["checkpoint"] = {"every": 1, "keep": 5}  # how often it saves does not change its numbers
    assert check_output_dir(out, validate_dict(base_config), resume=True) == RESUME
    saved = yaml.safe_load((out / "config.yaml").read_text())
    del saved["checkpoint"]["every_minutes"]  # a run started before the time trigger existed
    (out / "config.yaml").write_text(yaml.safe_dump(saved))
    assert check_output_dir(out, cfg, resume=True) == RESUME


def test_a_run_stopped_in_its_warmup_after_a_checkpoint_is_continued_by_resume_only(base_config, tmp_path):
    cfg = validate_dict(base_config)
    out = started(tmp_path / "r", base_config)
    warm = out / "checkpoints" / "warmup-00000020"
    warm.mkdir(parents=True)
    (warm / "manifest.json").write_text(json.dumps({"step": 20, "files": {}}))
    with pytest.raises(UserError, match=r"already holds a run; choose another directory, or add --resume"):
        check_output_dir(out, cfg, resume=False)
    assert check_output_dir(out, cfg, resume=True) == RESUME


def test_a_finished_run_is_extended_with_more_steps(base_config, tmp_path):
    out = started(tmp_path / "r", base_config, checkpoints=(1, 2), finished=True)  # trainer.steps: 2
    cfg = validate_dict(base_config)
    with pytest.raises(UserError) as e:
        check_output_dir(out, cfg, resume=False)
    assert e.value.messages == [f"--output-dir: {out} already holds a finished run; choose another directory, or "
                                f"train it longer: --resume with trainer.steps=N (more than 2)"]
    with pytest.raises(UserError) as e:
        check_output_dir(out, cfg, resume=True)
    assert e.value.messages == [f"--resume: {out} is a finished run (2 steps, summary.json); nothing to resume; to "
                                f"train it longer: --resume with trainer.steps=N (more than 2)"]
    base_config["trainer"]["steps"] = 5
    assert check_output_dir(out, validate_dict(base_config), resume=True) == EXTEND
    begin_attempt(out, EXTEND)
    assert not (out / "summary.json").exists()  # unfinished again until it ends
    base_config["algorithm"]["kl_coef"] = 0.5  # more steps and another change: not an extension
    with pytest.raises(UserError) as e:
        check_output_dir(out, validate_dict(base_config), resume=True)
    assert [m.split(" differs")[0] for m in e.value.messages] == ["--resume: algorithm.kl_coef",
                                                                  "--resume: trainer.steps"]


def test_a_cosine_run_is_not_extended_the_new_run_from_final_is_named(base_config, tmp_path):
    base_config["policy"]["train"]["lr_schedule"] = "cosine"
    base_config["warmup"] = {"steps": 2, "batch_size": 16}
    out = started(tmp_path / "r", base_config, checkpoints=(2,), finished=True)
    base_config["trainer"]["steps"] = 6
    with pytest.raises(NewRunNeeded) as e:
        check_output_dir(out, validate_dict(base_config), resume=True)
    assert e.value.changes == {"policy.model": str(out / "final"), "trainer.steps": "4", "warmup.steps": "0"}
    line = e.value.line("cfg.yaml", ["trainer.steps=6", "algorithm.kl_coef=0.05"])
    assert line.startswith(f"--resume: trainer.steps 2 -> 6 cannot continue {out}: its policy.train.lr_schedule "
                           f"(cosine) decays over the run's 2 steps; start a new run from its final policy")
    assert line.endswith(f": xrlhf run cfg.yaml algorithm.kl_coef=0.05 policy.model={out / 'final'} trainer.steps=4 "
                         f"warmup.steps=0 --output-dir {out}-continued")
    (out / "final" / "config.json").unlink()  # final/ holds a LoRA adapter only: no command to name
    (out / "final" / "adapter_config.json").write_text("{}")
    with pytest.raises(UserError) as e:
        check_output_dir(out, validate_dict(base_config), resume=True)
    assert not isinstance(e.value, NewRunNeeded) and "only a LoRA adapter in final/" in e.value.messages[0]


def test_the_cli_names_the_new_run_with_its_config_and_overrides(base_config, tmp_path, capsys, restore_environ):
    from xrlhf.cli import main

    base_config["policy"]["train"]["lr_schedule"] = "cosine"
    out = started(tmp_path / "r", base_config, checkpoints=(2,), finished=True)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(base_config))
    assert main(["run", str(tmp_path / "cfg.yaml"), "trainer.steps=3", "--output-dir", str(out), "--resume"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.endswith(f"xrlhf run {tmp_path / 'cfg.yaml'} policy.model={out / 'final'} trainer.steps=1 "
                         f"--output-dir {out}-continued")
