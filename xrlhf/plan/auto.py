"""``layout: auto``: the planner's fastest layout applied to a config before it is validated.

Why here and not in the config layer: choosing needs the planner (shapes, memory, time), which
the schema must not import. ``xrlhf validate`` and ``xrlhf run`` call ``apply_auto_layout`` on
the config dict (``validation.validate_dict``); ``xrlhf plan`` shows the same choice. A value
the config or an override sets is never changed: a layout that would change one is not chosen
(``search.conflicts``), and when none is left the run stops with one line saying so.
"""

from __future__ import annotations

import copy

from loguru import logger

from xrlhf.plan import machine
from xrlhf.plan.layouts import Cluster
from xrlhf.plan.search import Option, search
from xrlhf.plan.speed import Speeds, gpu_kind, speeds_for
from xrlhf.utils.errors import UserError


def choose(data: dict, cluster: Cluster, speeds: Speeds, prompt_tokens: int = 64) -> tuple[Option | None,
                                                                                            list[Option]]:
    """The fastest layout of ``data`` on ``cluster`` that fits and keeps every value ``data``
    sets (``None`` when none does), and every layout weighed."""
    options = search(data, cluster, speeds, prompt_tokens, keep=data)
    return next((o for o in options if o.fits), None), options


def local_cluster(data: dict) -> Cluster | None:
    """This machine as the run would use it: ``ray.num_gpus`` GPUs (default: every GPU
    ``nvidia-smi`` lists) of the first GPU's memory; ``None`` without a GPU."""
    gib = machine.gpu_total_gib()
    if not gib:
        return None
    ray = data.get("ray") if isinstance(data.get("ray"), dict) else {}
    gpus = ray.get("num_gpus") if isinstance(ray.get("num_gpus"), int) else machine.gpu_count()
    return Cluster(max(1, gpus), 1, gib)


def apply_auto_layout(data: dict, cluster: Cluster | None = None, speeds: Speeds | None = None,
                      prompt_tokens: int = 64) -> dict:
    """``data`` (a config dict with ``layout: auto``) with the chosen layout's overrides applied
    (a copy). Unchanged where the config does not validate or read (its own errors say why
    later) or where no GPU is seen (a CPU machine: nothing to place). Raises ``UserError`` when
    no layout fits."""
    from xrlhf.config.loader import apply_overrides

    cluster = cluster or local_cluster(data)
    if cluster is None:
        logger.warning("layout: auto: no GPU seen here (nvidia-smi), so the layout as written is validated; "
                       "xrlhf plan CONFIG --gpus N --gpu-memory GIB shows what auto chooses on a machine")
        return data
    speeds = speeds or speeds_for(gpu_kind(cluster.gpu_gib))
    try:
        best, options = choose(data, cluster, speeds, prompt_tokens)
    except UserError:
        return data
    where = f"{cluster.total_gpus} GPU(s) of {cluster.gpu_gib:g} GiB"
    if best is None:
        why = options[0].verdict() if options else "no GPU is left to the policy"
        raise UserError(f"layout: auto: no layout fits {where}: the closest: {why}; xrlhf plan CONFIG shows every "
                        f"layout (remove layout: auto to run the layout as written)")
    logger.info(f"layout: auto: {best.placement.describe()}, policy {best.trainer()}, planned "
                f"{best.time.total:.1f} s/step on {where}: {' '.join(best.args())}")
    return apply_overrides(copy.deepcopy(data), best.args())
