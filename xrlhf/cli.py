"""``xrlhf`` command line: run, validate, plan, hooks, make-tiny-model, make-dataset, prepare-data,
make-completions.

User errors (config, paths, data) print one line each and exit 2, without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import sys
from pathlib import Path

from loguru import logger

from xrlhf import internals
from xrlhf.internals.process import quick_exit
from xrlhf.utils.errors import NonFiniteError, UserError, WorkerDiedError
from xrlhf.utils.warnings_once import one_line_warnings


# The commands whose arguments a module of their own adds: (help, module, its function). Only the
# command being run imports its module; the others import torch or transformers (seconds), which
# ``xrlhf --help``, ``xrlhf validate`` and a config error do not need.
COMMANDS = {
    "plan": ("memory per GPU, phase and layout, before anything starts", "xrlhf.plan.cli", "add_arguments"),
    "make-tiny-model": ("build a small model and tokenizer locally", "xrlhf.models.make", "add_arguments"),
    "make-dataset": ("write a preference / KTO / Q&A dataset built from the reasoning env, or arithmetic word "
                     "problems for the dataset env", "xrlhf.envs.synthetic", "add_arguments"),
    "prepare-data": ("build the datasets the shipped configs read (configs/*.yaml)", "xrlhf.envs.synthetic",
                     "add_prepare_arguments"),
    "make-completions": ("a model's completions of an env's training prompts (distillation's teacher data)",
                         "xrlhf.completions", "add_arguments"),
}


def _parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser; of ``COMMANDS``, only ``command``'s arguments are added."""
    p = argparse.ArgumentParser(prog="xrlhf", description="RLHF that runs on a laptop CPU and scales to GPUs.")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train as a config says")
    run.add_argument("config")
    run.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algorithm.kl_coef=0.05")
    run.add_argument("--output-dir", default=None, help="default: runs/<config name>-<timestamp>")
    run.add_argument("--resume", action="store_true", help="continue the run in --output-dir from its latest checkpoint")
    hooks = sub.add_parser("hooks", help="the uses of libraries' internals, the releases each was checked on, and "
                           "whether it is on here")
    rep = sub.add_parser("report", help="(re)write report.md and plots of a run directory")
    rep.add_argument("run_dir")
    val = sub.add_parser("validate", help="check a config and print every problem")
    val.add_argument("config")
    val.add_argument("overrides", nargs="*")
    for parser in (run, val, hooks):
        parser.add_argument("--public-only", action="store_true",
                            help="only the public APIs of Ray, vLLM, torch and transformers: every hook of "
                                 "xrlhf.internals off (xrlhf hooks lists them)")
    for name, (text, module, add) in COMMANDS.items():
        parser = sub.add_parser(name, help=text)
        if name == command:
            getattr(importlib.import_module(module), add)(parser)
    return p


def main(argv: list[str] | None = None) -> int:
    """The ``xrlhf`` command; ``argv``: its arguments (``None``: this process's command line, when a
    run aborted by a second signal ends the process at once)."""
    program = argv is None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # per-worker "Loading weights" bars: noise
    logger.remove()
    one_line_warnings()
    logger.add(sys.stderr, level=os.environ.get("XRLHF_LOG_LEVEL", "INFO"),
               format="<green>{time:HH:mm:ss}</green> | <level>{level: <7}</level> | {message}")
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser(next((a for a in argv if not a.startswith("-")), None))
    args, rest = parser.parse_known_args(argv)
    unknown = [r for r in rest if r.startswith("-") or "=" not in r or not hasattr(args, "overrides")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if rest:
        args.overrides = list(args.overrides) + rest
    args.program = program
    try:
        return _dispatch(args)
    except UserError as e:
        for line in e.messages:
            print(f"error: {line}", file=sys.stderr)
        return 2
    except (WorkerDiedError, NonFiniteError) as e:
        logger.error(str(e))
        return 1
    except KeyboardInterrupt:
        if program:
            quick_exit(130)
        return 130


def _dispatch(args: argparse.Namespace) -> int:
    if getattr(args, "public_only", False):  # before anything imports: the workers inherit it
        os.environ[internals.PUBLIC_ONLY] = "1"
    if args.command == "hooks":
        print(internals.table())
        return 0
    if args.command == "make-tiny-model":
        from xrlhf.models import make

        return make.run(args)
    if args.command == "report":
        from xrlhf.report import write_report

        print(write_report(args.run_dir))
        return 0
    if args.command == "plan":
        from xrlhf.plan import cli as plan_cli

        return plan_cli.run(args)
    if args.command == "make-dataset":
        from xrlhf.envs import synthetic

        return synthetic.run(args)
    if args.command == "prepare-data":
        from xrlhf.envs import synthetic

        return synthetic.prepare(args)
    if args.command == "make-completions":
        from xrlhf import completions

        return completions.run(args)
    if args.command == "run":  # vLLM's import (a fork server) begins before this process imports anything heavy
        from xrlhf.coordinator.forkserver import start_early

        start_early(args.config, args.overrides)
    from xrlhf.validation import load_config

    cfg = load_config(args.config, args.overrides)
    if args.command == "validate":
        print(f"{args.config}: ok")
        return 0
    from xrlhf.rundir import NewRunNeeded
    from xrlhf.runner import Interrupted, default_output_dir, run

    if args.resume and not args.output_dir:
        raise UserError("--resume needs --output-dir: the run directory to continue")
    out = args.output_dir or str(default_output_dir(cfg))
    again = resume_command(args.config, out, args.overrides, resume=False)
    try:
        # absolute: workers write their checkpoint state and load the warm-up's model by the paths the
        # driver hands them, from their own working directory (on a cluster: where their node started)
        run(cfg, Path(out).absolute(), resume=args.resume)
    except NewRunNeeded as e:  # its command with this config and these overrides
        raise UserError(e.line(args.config, args.overrides)) from None
    except Interrupted as e:
        if e.saved:
            logger.warning(f"{e}; resume with: {resume_command(args.config, out, args.overrides)}")
        else:
            logger.warning(f"{e}; start it again (it starts over in the same directory) with: {again}")
        if e.urgent and args.program:  # a second signal: no teardown of every module (a second of it)
            quick_exit(e.code)
        return e.code
    except WorkerDiedError as e:
        from xrlhf.checkpoint import any_checkpoint

        ckpt = any_checkpoint(Path(out))
        how = (f"continue from {ckpt.name} with: {resume_command(args.config, out, args.overrides)}" if ckpt
               else f"no checkpoint was written; start it again (it starts over in the same directory) with: {again}")
        n = cfg.fault_tolerance.max_restarts
        logger.error(f"{e}; {how}. " + (f"fault_tolerance.max_restarts: all {n} restarts were used" if n else
                     "fault_tolerance.max_restarts: N heals dead workers on its own (0 here: off)"))
        return 1
    return 0


def resume_command(config: str, out: str, overrides: list[str], resume: bool = True) -> str:
    """The command that continues the run in ``out``: the same config and overrides, ``--resume``
    (``resume=False``: without it, which starts a run that saved nothing over)."""
    return shlex.join(["xrlhf", "run", config, *overrides, "--output-dir", str(out), *(["--resume"] if resume else [])])


if __name__ == "__main__":
    sys.exit(main())
