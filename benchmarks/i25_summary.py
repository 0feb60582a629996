"""The figures of benchmarks/gpu_i25_gen.sh in one table, and the ratios issue 25 asks for.

    python -m benchmarks.i25_summary $OUT/i25

prints every configuration's variants (seconds, tokens/s), the start-ups, and the generation
phase of W's engine against ``vllm.LLM.generate`` alone (target <= 1.1); writes ``summary.json``
next to what it read. Reads whatever JSON the stages managed to write.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import table


def _load(d: Path, name: str) -> dict[str, Any]:
    f = d / name
    try:
        return json.loads(f.read_text()) if f.is_file() else {}
    except json.JSONDecodeError:
        return {}


def summarize(d: Path) -> dict[str, Any]:
    rows, out = [], {}
    for name in ("generation-main.json", "generation-configs.json"):
        for config, entry in _load(d, name).get("configs", {}).items():
            rows.append((config, "start-up", entry.get("startup_s"), None))
            for v, r in entry["variants"].items():
                rows.append((config, v, r.get("seconds"), r.get("tokens_per_s")))
    main = _load(d, "generation-main.json").get("configs", {}).get("w", {}).get("variants", {})
    ceiling = main.get("raw_no_logprobs", {}).get("seconds")
    if ceiling:
        out["ratio_to_vllm_alone"] = {v: round(r["seconds"] / ceiling, 3) for v, r in main.items() if "seconds" in r}
    for v in _load(d, "startup-engine.json").get("variants", []):
        rows.append((f"start-up {v['variant']}", "import + engine", v.get("import_s"), v.get("engine_s")))
        for g in ("generate_logprobs", "generate_no_logprobs"):
            if g in v:
                rows.append((f"start-up {v['variant']}", g, v[g]["seconds"], v[g]["tokens_per_s"]))
    two = _load(d, "vllm_overhead.json").get("engines_per_gpu_2", {})
    for run in ("xrlhf_engine", "no_logprobs"):
        if run in two:
            rows.append(("two engines", run, two[run]["seconds"], two[run]["tokens_per_s"]))
    out["cold_startup_lines"] = _load(d, "main-startup.json").get("vllm")
    print(table(rows, ["config", "variant", "seconds", "tokens/s (start-up: engine s)"]))
    for k, v in out.items():
        print(k, v)
    (d / "summary.json").write_text(json.dumps({"rows": rows, **out}, indent=1) + "\n")
    return out


if __name__ == "__main__":
    summarize(Path(sys.argv[1]))
