"""``xrlhf plan CONFIG [overrides] [--gpus N --gpu-memory GIB --nodes M]``: the plan of a config,
printed as text, optionally drawn (``--png``), with every way of using the GPUs ranked by planned
step time (``plan.search``); ``--apply`` prints only the fastest one's overrides. Reads the config
and the models' ``config.json`` only: no engine is built, no package but the planner's is needed,
and the models may be shapes without weights (configs/shapes/)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. policy.resources.ranks=8")
    p.add_argument("--gpus", type=int, default=None, help="GPUs per node (default: what the config asks for)")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpu-memory", type=float, default=None, dest="gpu_memory",
                   help="GiB per GPU as torch reports it (default: this machine's GPU, else 79.2: an H100 80GB)")
    p.add_argument("--prompt-tokens", type=int, default=64, dest="prompt_tokens", help="a prompt's tokens (default 64)")
    p.add_argument("--link", action="append", default=[], metavar="NAME=GIB_S",
                   help="a link's speed: cuda_ipc, cpu, disk, nvlink, ib")
    p.add_argument("--png", default=None, help="also draw the plan into this PNG")
    p.add_argument("--gpu-kind", default=None, dest="gpu_kind",
                   help="h100, h200 or a100: the step-time model's HBM bandwidth and FLOP/s (default: by the memory)")
    p.add_argument("--speed", action="append", default=[], metavar="NAME=VALUE",
                   help="a constant of the step-time model (xrlhf/plan/speed.py: mfu, decode_mfu, host_us_per_seq, "
                        "tp_efficiency, zero3_efficiency, hbm_tb_s, tflops)")
    p.add_argument("--apply", nargs="?", type=int, const=1, default=None, metavar="N",
                   help="print only the overrides of the fastest layout that fits (or of the ranking's #N): "
                        "xrlhf run CONFIG $(xrlhf plan CONFIG --apply); exit 2 when none fits")


def read_for_plan(config: str, overrides: list[str]) -> dict:
    """The config dict with its overrides, named as ``xrlhf run`` names it."""
    from xrlhf.config.loader import apply_overrides, read_yaml

    data = apply_overrides(read_yaml(config), list(overrides))
    data.setdefault("name", Path(config).stem)
    return data


def validated(data: dict):
    """``data`` validated by the schema alone: a plan needs no dataset, tokenizer or installed
    backend (each engine's options are validated when the plan reads them)."""
    from pydantic import ValidationError

    from xrlhf.config.loader import format_errors
    from xrlhf.config.schema import XConfig
    from xrlhf.utils.errors import UserError

    try:
        return XConfig.model_validate(data)
    except ValidationError as e:
        raise UserError(*format_errors(e, XConfig)) from None


def load_for_plan(config: str, overrides: list[str]):
    """The config validated by its schema and its engines' options, nothing else."""
    return validated(read_for_plan(config, overrides))


def _links(items: list[str]) -> dict[str, float]:
    from xrlhf.plan.sync import LINKS
    from xrlhf.utils.errors import UserError

    out = {}
    for item in items:
        name, _, value = item.partition("=")
        try:
            out[name] = float(value)
        except ValueError:
            raise UserError(f"--link {item}: give NAME=GIB_S, e.g. ib=25") from None
        if name not in LINKS:
            raise UserError(f"--link {item}: unknown link {name!r}; valid: {', '.join(LINKS)}")
    return out


def run(args: argparse.Namespace) -> int:
    import shlex

    from xrlhf.config.loader import apply_overrides
    from xrlhf.plan import Cluster, gpus_asked, make_plan, plan_input
    from xrlhf.plan.render import plan_png, plan_text
    from xrlhf.plan.search import search
    from xrlhf.plan.speed import gpu_kind, speeds_for
    from xrlhf.utils.errors import UserError
    from xrlhf.plan import machine

    data = read_for_plan(args.config, args.overrides)
    cfg = validated(data)
    gib = args.gpu_memory or machine.gpu_total_gib() or 79.2
    gpus = args.gpus or max(gpus_asked(plan_input(cfg, args.prompt_tokens)), cfg.ray.num_gpus or 0)
    cluster = Cluster(gpus, args.nodes, gib)
    speeds = speeds_for(gpu_kind(gib, args.gpu_kind), args.speed)
    auto = cfg.layout == "auto"
    if auto and args.gpus and cfg.ray.num_gpus is not None:  # --gpus names the machine layout: auto plans for
        data = apply_overrides(data, [f"ray.num_gpus={cluster.total_gpus}"])
    options = search(data, cluster, speeds, args.prompt_tokens, keep=data if auto else None)
    best = next((o for o in options if o.fits), None)
    if args.apply is not None:
        fitting = [o for o in options if o.fits]
        if not fitting:
            raise UserError(f"no layout fits {cluster.total_gpus} GPU(s) of {gib:g} GiB; xrlhf plan without --apply "
                            f"says why")
        if not 1 <= args.apply <= len(fitting):
            raise UserError(f"--apply {args.apply}: the ranking has {len(fitting)} layout(s) that fit; give 1 to "
                            f"{len(fitting)}")
        print(shlex.join(fitting[args.apply - 1].args()))
        return 0
    if auto and best is not None:  # the plan of what layout: auto runs
        cfg = validated(apply_overrides(data, best.args()))
    plan = make_plan(plan_input(cfg, args.prompt_tokens), cluster)
    plan.ranking, plan.speeds, plan.auto = options, speeds, auto
    print(plan_text(plan, args.config, _links(args.link)))
    if args.png:
        print(f"\n![plan]({plan_png(plan, Path(args.png))})")
    return 0 if plan.configured.fits else 2
