"""The memory picture of a step, phase by phase (``logging.memory_timeline``).

After each phase of a step (generate, sleep, infer, train, sync) the trainer asks every
handle's processes for their memory (``EngineHost.memory_stats``: on a GPU the peak allocated
since the previous phase's mark, and the device's use at the mark by every process; on CPU the
resident set at the mark). ``memory_metrics`` turns one such answer into metrics:

* ``memory/<phase>/<handle>_gib``: the largest of the handle's ranks (its ranks are alike):
  GPU: the peak torch allocation during the phase; CPU: the resident set at its end;
* ``memory/<phase>/device_gib``: GPU only: the device's memory in use at the phase's end, by
  every process (vLLM's KV cache included), the largest over the devices;
* ``memory/<phase>/<handle>_retries``: GPU only, where it happened: how often the handle's
  allocator found the device full during the phase and freed its cache to try again (the most of
  its ranks): its token budget fills the device (what that costs: docs/training.md).

No Ray here: a leaf of the layer graph.
"""

from __future__ import annotations

from typing import Any

PHASES = ("generate", "sleep", "infer", "train", "sync")
"""The phases a step marks, in order (an asynchronous step marks train and sync)."""


def memory_metrics(phase: str, stats: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
    """``{handle: [per-rank memory_stats]}`` at the end of ``phase`` -> ``memory/<phase>/...`` metrics (GiB)."""
    out: dict[str, float] = {}
    device = []
    for handle, ranks in stats.items():
        values = [r.get("max_allocated_gb", r.get("rss_gb")) for r in ranks]
        values = [v for v in values if v is not None]
        if values:
            out[f"memory/{phase}/{handle}_gib"] = round(max(values), 4)
        retries = max((r.get("alloc_retries", 0) for r in ranks), default=0)
        if retries:
            out[f"memory/{phase}/{handle}_retries"] = float(retries)
        device += [r["device_used_gb"] for r in ranks if "device_used_gb" in r]
    if device:
        out[f"memory/{phase}/device_gib"] = round(max(device), 4)
    return out


def memory_table(rows: list[dict[str, Any]]) -> tuple[list[str], list[str], dict[tuple[str, str], float]]:
    """The mean over steps of every ``memory/<phase>/<name>_gib`` metric: (phases in order,
    names, {(phase, name): GiB})."""
    sums: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        for k, v in r.items():
            if k.startswith("memory/") and k.endswith("_gib") and isinstance(v, (int, float)):
                _, phase, name = k.split("/", 2)
                sums.setdefault((phase, name[:-4]), []).append(float(v))
    means = {key: sum(v) / len(v) for key, v in sums.items()}
    phases = [p for p in PHASES if any(k[0] == p for k in means)]
    phases += sorted({k[0] for k in means} - set(phases))
    names = sorted({k[1] for k in means} - {"device"}) + (["device"] if any(k[1] == "device" for k in means) else [])
    return phases, names, means
