"""Find what makes vLLM's start-up hang with multiprocessing on and CUDA graphs on.

Seen once on the GPU machine (docs/vllm.md): ``LLM(...)`` with vLLM's defaults
(``VLLM_ENABLE_V1_MULTIPROCESSING=1``, CUDA graphs and torch.compile on) did not return in 6
minutes, while multiprocessing off + ``enforce_eager`` started. Each probe below starts vLLM
once in a fresh process under a time limit, with one knob changed; every process of the probe
(vLLM's engine process included, spawned or forked) dumps the stacks of all its threads when
the limit is reached (SIGUSR2, ``benchmarks/gpu_site``), so a hang shows where it waits. The driver picks the next probe from
the results so far and stops when its time budget is spent.

    python -m benchmarks.vllm_hang_probe --out OUT/hang [--budget 500] [--timeout 170] [--only a,b]

writes ``OUT/hang/summary.json`` (per probe: ok / hang / error, seconds, the last log lines,
the top of the stack dumps), each probe's log and dumps, and prints the conclusion with the
``XRLHF_VLLM`` setting to use if vLLM's defaults cannot be kept.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HYGIENE = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
"""What xrlhf's engine sets before importing vLLM: no network on the way up."""

PROBES: dict[str, dict] = {
    "default": {"about": "vLLM defaults (multiprocessing on, torch.compile + CUDA graphs on), no-network env"},
    "as_first_seen": {"about": "the same without the no-network env (usage stats on, IP probe, hub online)",
                      "unset": list(HYGIENE)},
    "usage_stats_on": {"about": "defaults, usage-stats thread on (it posts to stats.vllm.ai, no timeout)",
                       "unset": ["VLLM_NO_USAGE_STATS", "DO_NOT_TRACK"]},
    "ip_probe_on": {"about": "defaults, VLLM_HOST_IP unset (get_ip() probes 8.8.8.8)", "unset": ["VLLM_HOST_IP"]},
    "hub_online": {"about": "defaults, HF_HUB_OFFLINE unset", "unset": ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"]},
    "mp_off": {"about": "engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), CUDA graphs on",
               "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}},
    "eager": {"about": "multiprocessing on, enforce_eager (no compile, no graphs)", "llm": {"enforce_eager": True}},
    "spawn": {"about": "engine process spawned instead of forked", "env": {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}},
    "no_cudagraphs": {"about": "torch.compile on, CUDA graphs off",
                      "llm": {"compilation_config": {"cudagraph_mode": "NONE"}}},
    "no_inductor": {"about": "torch.compile off, decode CUDA graphs on",
                    "llm": {"compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}}},
    "few_graphs": {"about": "max_num_seqs 16: a handful of graph sizes", "llm": {"max_num_seqs": 16}},
    "v1_runner": {"about": "the V1 model runner (V2 is the default for dense models)",
                  "env": {"VLLM_USE_V2_MODEL_RUNNER": "0"}},
    "no_cache": {"about": "no compile cache, no AOT compile", "env": {"VLLM_DISABLE_COMPILE_CACHE": "1",
                                                                       "VLLM_USE_AOT_COMPILE": "0"}},
    "xrlhf_engine": {"about": "xrlhf's vLLM engine (spawned engine process, sleep mode, worker extension, CUDA "
                              "graphs on): start, generate, sleep, wake, generate", "engine": True},
    "ray_engine": {"about": "the same in a Ray actor with a fractional GPU (the co-located layout)", "engine": True,
                   "ray": True},
    "sleep_mode": {"about": "vLLM defaults + enable_sleep_mode (the CuMem allocator under graph capture)",
                   "llm": {"enable_sleep_mode": True}},
    "engine_nosleep": {"about": "xrlhf's engine with sleep_level 0 (no CuMem allocator)", "engine": True,
                       "options": {"sleep_level": 0}},
    "engine_fork": {"about": "xrlhf's engine with its engine process forked", "engine": True,
                    "env": {"VLLM_WORKER_MULTIPROC_METHOD": "fork"}},
}

FIXES = {  # probe that starts -> the XRLHF_VLLM setting that keeps the rest of the defaults
    "engine_fork": {"engine_options": {"env": {"VLLM_WORKER_MULTIPROC_METHOD": "fork"}}},
    "engine_nosleep": {"sleep_level": 0},
    "spawn": {"engine_options": {"env": {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}}},
    "v1_runner": {"engine_options": {"env": {"VLLM_USE_V2_MODEL_RUNNER": "0"}}},
    "no_cache": {"engine_options": {"env": {"VLLM_DISABLE_COMPILE_CACHE": "1", "VLLM_USE_AOT_COMPILE": "0"}}},
    "few_graphs": {"max_num_seqs": 16},
    "no_inductor": {"engine_options": {"compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}}},
    "no_cudagraphs": {"engine_options": {"compilation_config": {"cudagraph_mode": "NONE"}}},
    "mp_off": {"engine_options": {"env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}},
    "eager": {"enforce_eager": True},
}
"""In order of preference: the first that starts is recommended (CUDA graphs kept if possible)."""

SITE = Path(__file__).resolve().parent / "gpu_site"
"""``sitecustomize.py`` there: every process of a probe dumps its stacks on SIGUSR2 (no timer
thread: re-arming ``faulthandler.dump_traceback_later`` after ``fork()`` deadlocks the child,
which is what made the first session's probes hang, see benchmarks/results/notes.md)."""


# -- one probe, in its own process ----------------------------------------------------------------
def probe(name: str, model: str) -> None:
    spec = PROBES[name]
    t0 = time.time()
    if spec.get("engine"):
        return probe_engine(model, t0, spec.get("ray", False), spec.get("options", {}))
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=model, gpu_memory_utilization=0.3, seed=0, **spec.get("llm", {}))
    started = time.time() - t0
    out = llm.generate([TokensPrompt(prompt_token_ids=[1, 10 + i, 20 + i]) for i in range(8)],
                       SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)
    print("PROBE_RESULT " + json.dumps({"startup_s": started, "total_s": time.time() - t0}), flush=True)


class EngineCycle:
    """xrlhf's engine as the co-located layout uses it (a Ray actor class, or a plain object)."""

    def __init__(self, model: str, options: dict | None = None):
        from benchmarks.common import vllm_options
        from xrlhf.engines.base import EngineSpec
        from xrlhf.engines.vllm import VLLMGenerateEngine

        fields = {"gpu_memory_utilization": 0.3, "sleep_level": 1, "max_model_len": 512, "max_num_seqs": 256,
                  **(options or {})}
        self.engine = VLLMGenerateEngine(EngineSpec(model, device="cuda",
                                                    options={**vllm_options(**fields), "dtype": "bfloat16"}))

    def cycle(self) -> list[float]:
        from xrlhf.engines.base import SamplingParams

        times, params = [], SamplingParams(max_new_tokens=8, ignore_eos=True)
        for step in (lambda: self.engine.generate([[1, 10, 20]] * 8, params), self.engine.sleep,
                     self.engine.wake_up, lambda: self.engine.generate([[1, 10, 20]] * 8, params)):
            t = time.time()
            step()
            times.append(time.time() - t)
        return times


def probe_engine(model: str, t0: float, in_ray: bool, options: dict) -> None:
    if not in_ray:
        times = EngineCycle(model, options).cycle()
    else:
        import ray

        ray.init(num_gpus=1, include_dashboard=False, logging_level="WARNING",
                 runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
        try:
            times = ray.get(ray.remote(num_gpus=0.4)(EngineCycle).remote(model, options).cycle.remote())
        finally:
            ray.shutdown()
    print("PROBE_RESULT " + json.dumps({"startup_s": time.time() - t0 - sum(times),
                                        "generate_sleep_wake_generate_s": times, "total_s": time.time() - t0}),
          flush=True)


# -- the driver ---------------------------------------------------------------------------------------
def run_probe(name: str, model: str, out: Path, timeout: float) -> dict:
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    spec = PROBES[name]
    env = {**os.environ, **HYGIENE, "VLLM_LOGGING_LEVEL": "DEBUG", "XRLHF_STACKS_DIR": str(d)}
    for k in spec.get("unset", []):
        env.pop(k, None)
    env.update(spec.get("env", {}))
    env["PYTHONPATH"] = os.pathsep.join([str(SITE), env.get("PYTHONPATH", "")])
    print(f"[probe {name}] {spec['about']} (limit {timeout:.0f} s)", flush=True)
    t0 = time.time()
    with open(d / "log.txt", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "benchmarks.vllm_hang_probe", "--probe", name, "--model",
                                 model], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout)
            status = "ok" if rc == 0 else "error"
        except subprocess.TimeoutExpired:
            rc, status = None, "hang"
            dump_stacks(proc.pid)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the probe's whole process group: vLLM's engine too
            except ProcessLookupError:
                pass
            proc.wait()
    seconds = time.time() - t0
    wait_gpu_free()  # a local Ray started by the probe dies with it (Ray's fate sharing)
    text = (d / "log.txt").read_text(errors="replace").splitlines()
    result = {"about": spec["about"], "status": status, "rc": rc, "seconds": round(seconds, 1),
              "log_tail": [line[-300:] for line in text[-25:]]}
    for line in text:
        if line.startswith("PROBE_RESULT "):
            result.update(json.loads(line[len("PROBE_RESULT "):]))
    if status == "hang":
        result["stacks"] = stack_excerpts(d)
    print(f"[probe {name}] {status} in {seconds:.0f} s" + (f", started in {result['startup_s']:.0f} s"
                                                            if "startup_s" in result else ""), flush=True)
    return result


def dump_stacks(pgid: int) -> None:
    """Every process of the probe's group writes its stacks (SIGUSR2, see ``SITE``)."""
    try:
        os.killpg(pgid, signal.SIGUSR2)
    except ProcessLookupError:
        return
    time.sleep(3)


def stack_excerpts(d: Path, lines: int = 60) -> dict[str, list[str]]:
    """The first ``lines`` lines of each process's dump (threads, most recent call first)."""
    out = {}
    for f in sorted(d.glob("stacks_*.txt")):
        text = f.read_text(errors="replace").splitlines()
        if text:
            out[f.stem] = text[:lines]
    return out


def wait_gpu_free(limit_s: float = 30.0, below_mib: float = 2048) -> None:
    """Wait until GPU 0 is (nearly) empty again: a killed probe's memory takes a moment to go."""
    t0 = time.time()
    while time.time() - t0 < limit_s:
        try:
            q = subprocess.run(["nvidia-smi", "--id=0", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True)
            if float(q.stdout.strip().splitlines()[0]) < below_mib:
                return
        except (OSError, ValueError, IndexError):
            return
        time.sleep(1)


def plan(results: dict[str, dict]) -> list[str]:
    """The probes still worth running, in order, given the results so far."""
    if "default" not in results:
        return ["default"]
    bad = ("hang", "error")
    todo = ["xrlhf_engine", "ray_engine"]
    if results["default"]["status"] == "ok":
        if any(results.get(n, {}).get("status") in bad for n in ("xrlhf_engine", "ray_engine")):
            todo += ["sleep_mode", "engine_nosleep", "engine_fork"]
        todo.append("as_first_seen")
        if results.get("as_first_seen", {}).get("status") in bad:
            todo += ["usage_stats_on", "ip_probe_on", "hub_online"]
    else:
        todo += ["spawn", "mp_off", "no_cudagraphs", "no_inductor", "few_graphs", "v1_runner", "no_cache", "eager"]
    return [n for n in todo if n not in results]


def conclude(results: dict[str, dict]) -> tuple[str, dict | None]:
    """A sentence about the cause, and the ``XRLHF_VLLM`` setting to use (None: keep the defaults)."""
    st = {n: r["status"] for n, r in results.items()}
    bad = ("hang", "error")
    ours = [n for n in ("xrlhf_engine", "ray_engine") if n in st]
    ours_ok = bool(ours) and all(st[n] == "ok" for n in ours)
    parts = []
    if st.get("default") == "ok":
        if st.get("as_first_seen") in bad:
            culprits = [n for n in ("usage_stats_on", "ip_probe_on", "hub_online") if st.get(n) in bad]
            parts.append(f"vLLM's defaults start once the network is kept out of the start-up; without that they "
                         f"{st['as_first_seen']} (alone: {', '.join(culprits) or 'none of the knobs'})")
        elif "as_first_seen" in st:
            parts.append("not reproduced: multiprocessing on + CUDA graphs on start here, with and without the "
                         "no-network environment")
    elif "default" in st:
        fixes = [n for n in FIXES if st.get(n) == "ok"]
        still = [n for n in FIXES if st.get(n) in bad]
        parts.append(f"vLLM's defaults {st['default']}; these start: {', '.join(fixes) or '-'}; these do not: "
                     f"{', '.join(still) or '-'}")
    if st.get("default") == "ok" and not ours:
        r = results["default"]
        parts.append(f"vLLM's defaults (engine process forked, torch.compile and CUDA graphs on) start, in "
                     f"{r.get('startup_s', r['seconds']):.0f} s: keep them")
        return "; ".join(parts) + ".", None
    if ours_ok:
        parts.append("xrlhf's engine (spawned engine process, no-network environment, CUDA graphs on) starts, "
                     "alone and in a Ray actor: keep the defaults")
        return "; ".join(parts) + ".", None
    fix = next((n for n in FIXES if st.get(n) == "ok"), None)
    parts.append(f"xrlhf's engine: {', '.join(f'{n} {st[n]}' for n in ours) or 'not run'}; use the first working "
                 f"variant that keeps the most of the defaults: {fix or 'none found'}")
    return "; ".join(parts) + ".", FIXES.get(fix)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--probe", choices=sorted(PROBES), help="run one probe here (used by the driver)")
    p.add_argument("--model", default=None, help="default: artifacts/model-0.5b (built if missing)")
    p.add_argument("--out", default="hang-probe")
    p.add_argument("--budget", type=float, default=500.0, help="seconds for all probes")
    p.add_argument("--timeout", type=float, default=170.0, help="seconds per probe")
    p.add_argument("--only", default="", help="comma-separated probes to run instead of the plan")
    args = p.parse_args()
    if args.probe:
        return probe(args.probe, args.model)
    from benchmarks.common import MODEL_05B, ensure_model, gpu_name, write_json

    model = ensure_model(args.model or MODEL_05B)
    out = Path(args.out)
    results: dict[str, dict] = {}
    t_start = time.time()
    queue = [n for n in args.only.split(",") if n]
    while True:
        todo = queue or plan(results)
        todo = [n for n in todo if n not in results]
        left = args.budget - (time.time() - t_start)
        if not todo or left < 40:
            break
        name = todo[0]
        results[name] = run_probe(name, model, out, min(args.timeout, left))
    skipped = [n for n in (queue or plan(results)) if n not in results]
    conclusion, fix = conclude(results)
    write_json(out, "summary.json", {"gpu": gpu_name(), "model": model, "results": results, "not_run": skipped,
                                     "conclusion": conclusion, "XRLHF_VLLM": fix})
    print("\n".join(f"  {n:16s} {r['status']:5s} {r['seconds']:6.0f} s  {r['about']}" for n, r in results.items()))
    if skipped:
        print(f"not run (budget): {', '.join(skipped)} -> rerun with --only {','.join(skipped)}")
    print(f"conclusion: {conclusion}")
    print(f"export XRLHF_VLLM='{json.dumps(fix)}'" if fix else "XRLHF_VLLM: not needed")


if __name__ == "__main__":
    main()
