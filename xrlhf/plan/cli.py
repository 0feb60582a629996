"""``xrlhf plan CONFIG [overrides] [--gpus N --gpu-memory GIB --nodes M]``: the plan of a config,
printed as text, optionally drawn (``--png``). Reads the config and the models' ``config.json``
only: no engine is built, no package but the planner's is needed, and the models may be shapes
without weights (configs/shapes/)."""

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


def load_for_plan(config: str, overrides: list[str]):
    """The config validated by its schema and its engines' options, nothing else: a plan needs
    no dataset, tokenizer or installed backend."""
    from pydantic import ValidationError

    from xrlhf.config.loader import apply_overrides, format_errors, read_yaml
    from xrlhf.config.schema import XConfig
    from xrlhf.utils.errors import UserError

    data = apply_overrides(read_yaml(config), list(overrides))
    data.setdefault("name", Path(config).stem)
    try:
        return XConfig.model_validate(data)
    except ValidationError as e:
        raise UserError(*format_errors(e, XConfig)) from None


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
    from xrlhf.plan import Cluster, gpus_asked, make_plan, plan_input
    from xrlhf.plan.render import plan_png, plan_text
    from xrlhf.validation import _gpu_total_gib

    cfg = load_for_plan(args.config, args.overrides)
    inp = plan_input(cfg, args.prompt_tokens)
    gib = args.gpu_memory or _gpu_total_gib() or 79.2
    plan = make_plan(inp, Cluster(args.gpus or gpus_asked(inp), args.nodes, gib))
    print(plan_text(plan, args.config, _links(args.link)))
    if args.png:
        print(f"\n![plan]({plan_png(plan, Path(args.png))})")
    return 0 if plan.configured.fits else 2
