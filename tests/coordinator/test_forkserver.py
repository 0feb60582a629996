"""The fork server (``coordinator.forkserver``): a worker begins as a fork of a process that
imported its engines while Ray started (a preloading handle's from the server, any other's from
its plain copy, made before the long imports).

The protocol is tested with a probe script in place of Ray's worker entry point (what the child
runs, its environment, exit status and signals, the fallbacks); then a real local Ray runs a
handle whose engine preloads (``start_order_engines``), its worker forked from the server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from xrlhf.coordinator.forkserver import CLIENT, PLAIN_SOCKET, SOCKET, ForkServer

MODULE = "tests.coordinator.start_order_engines"
PROBE = '''
import json, os, sys, time
shy = sys.modules.get("tests.coordinator.ray_shy")
json.dump({"pid": os.getpid(), "ppid": os.getppid(), "forked": os.environ.get("XRLHF_FORKED_FROM"),
           "mine": os.environ.get("PROBE_VAR"), "host": "xrlhf.engines.host" in sys.modules,
           "llama": "transformers.models.llama.modeling_llama" in sys.modules,
           "argv": sys.argv, "cwd": os.getcwd(), "path": sys.path[:3],
           "shy_has_ray": None if shy is None else shy.ray is not None}, open(sys.argv[1], "w"))
time.sleep(float(sys.argv[2]))
sys.exit(5)
'''


@pytest.fixture()
def probe(tmp_path) -> Path:
    p = tmp_path / "probe.py"
    p.write_text(PROBE)
    return p


def wait_for(predicate, timeout: float = 120.0, what: str = "") -> None:
    deadline = time.time() + timeout
    while not predicate():
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def client(server: ForkServer | None, probe: Path, out: Path, sleep: float = 0.0, socket_path: str | None = None,
           **kwargs) -> subprocess.Popen:
    """The client as Ray would start it, with the probe as Ray's worker command."""
    path = socket_path or str(server.dir / SOCKET)
    env = {**os.environ, "PROBE_VAR": "from-the-client"}
    return subprocess.Popen([sys.executable, "-I", "-S", CLIENT, path, str(probe), str(out), str(sleep)],
                            cwd=str(out.parent), env=env, **kwargs)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_child_runs_the_command_with_the_engines_imported_and_the_clients_environment(tmp_path, probe):
    stamps = tmp_path / "stamps"
    server = ForkServer()
    server.start([(f"{MODULE}:RayShyGenerator", "generate", {"stamps": str(stamps)})])
    try:
        assert server.running and server.runtime_env()["py_executable"].endswith(str(server.dir / SOCKET))
        out = tmp_path / "out.json"
        c = client(server, probe, out)
        assert c.wait(180) == 5  # the child's exit status is the client's
        seen = json.loads(out.read_text())
        assert seen["ppid"] == server.proc.pid == int(seen["forked"]) and seen["pid"] != c.pid
        assert seen["host"], "the worker's modules were imported before the fork"
        assert seen["mine"] == "from-the-client" and seen["cwd"] == str(tmp_path)
        assert seen["argv"] == [str(probe), str(out), "0.0"] # as `python probe.py` (before Ray's own, which its import puts first)
        assert str(probe.parent) in seen["path"]
        assert (stamps / f"preload-{server.proc.pid}").is_file(), "the engine's preload ran in the server"
        # Ray was held back while the server imported; the module that tried is imported again in the child
        status = server.status()
        assert status["usable"] and status["retry"] == ["tests.coordinator.ray_shy"]
        assert seen["shy_has_ray"] is True
    finally:
        server.stop()
    assert server.proc is None and server.dir is None


def test_other_handles_fork_from_a_copy_made_before_the_long_imports(tmp_path, probe, tiny_model):
    """A trainer's worker is forked from the server's plain copy: the worker's class's modules and
    what its engine's build imports (``fork_imports``: the model's modeling module) are there,
    nothing of the preloading engines' (vLLM patches torch's compiler), nor their variables."""
    from xrlhf.engines.hf.train import HFTrainOptions
    from xrlhf.engines.spec import EngineSpec

    stamps = tmp_path / "stamps"
    spec = EngineSpec(tiny_model, device="cpu", options=HFTrainOptions(lr=1e-3))
    server = ForkServer()
    server.start({"long": [(f"{MODULE}:RayShyGenerator", "generate", {"stamps": str(stamps)})],
                  "plain": [("hf", "train", spec)]})
    try:
        plain_env = server.runtime_env(long=False)["py_executable"]
        assert plain_env.endswith(str(server.dir / PLAIN_SOCKET)) and plain_env != server.runtime_env()["py_executable"]
        outs = {"plain": tmp_path / "plain.json", "long": tmp_path / "long.json"}
        for kind, out in outs.items():
            c = client(server, probe, out, socket_path=str(server.dir / (PLAIN_SOCKET if kind == "plain" else SOCKET)))
            assert c.wait(180) == 5
        plain, long = (json.loads(outs[k].read_text()) for k in ("plain", "long"))
        status = server.status()
        assert status["usable"] and status["plain_pid"] != server.proc.pid
        assert plain["ppid"] == status["plain_pid"] == int(plain["forked"]) and long["ppid"] == server.proc.pid
        assert plain["host"] and plain["llama"], "the worker's modules and its build's imports came before the fork"
        assert plain["shy_has_ray"] is None and long["shy_has_ray"] is True, "the long imports stay out of the copy"
        assert plain["mine"] == "from-the-client"
        assert status["plain_at"] <= status["imported_at"]
    finally:
        server.stop()
    wait_for(lambda: not alive(status["plain_pid"]), 60, "the copy's end with the server")


def test_signals_reach_the_child_and_a_killed_client_takes_its_child_along(tmp_path, probe):
    server = ForkServer()
    server.start([(f"{MODULE}:AloneGenerator", "generate", {"stamps": str(tmp_path / "stamps")})])
    try:
        outs = [tmp_path / "a.json", tmp_path / "b.json"]
        clients = [client(server, probe, out, sleep=300) for out in outs]
        for out in outs:
            wait_for(lambda: out.exists() and out.stat().st_size > 0, what="the probe's report")
        children = [json.loads(out.read_text())["pid"] for out in outs]
        # SIGTERM to the client (how Ray stops a worker) goes on to the child; the client ends as it did
        clients[0].send_signal(signal.SIGTERM)
        assert clients[0].wait(60) == -signal.SIGTERM
        wait_for(lambda: not alive(children[0]), 60, "the first child's end")
        # SIGKILL cannot be forwarded: the server sees the client's connection close and kills the child
        clients[1].kill()
        clients[1].wait(60)
        wait_for(lambda: not alive(children[1]), 60, "the second child's end")
        assert server.running, "the server outlives its workers"
    finally:
        server.stop()


def test_without_a_usable_server_the_client_becomes_the_usual_worker(tmp_path, probe):
    out = tmp_path / "out.json"
    c = client(None, probe, out, socket_path=str(tmp_path / "no-such-socket"))
    assert c.wait(120) == 5
    seen = json.loads(out.read_text())
    assert seen["pid"] == c.pid and seen["forked"] is None and not seen["host"]  # exec'd: the same process
    server = ForkServer()
    server.start([(f"{MODULE}:BrokenPreload", "generate", {"stamps": str(tmp_path / "stamps")})])
    try:
        wait_for(lambda: server.status(), 180, "the server's imports")
        server.proc.wait(60)  # a server that cannot serve ends
        c = client(server, probe, out)
        assert c.wait(180) == 5
        seen = json.loads(out.read_text())
        assert seen["pid"] == c.pid and seen["forked"] is None
        status = server.status()
        assert not status["usable"] and "not_installed" in status["why"]
    finally:
        server.stop()


def test_a_server_whose_driver_dies_ends(tmp_path):
    """Whatever ends the driver (here SIGKILL), its fork server does not linger, nor its directory."""
    code = (f"from xrlhf.coordinator.forkserver import SERVER\n"
            f"SERVER.start([('{MODULE}:AloneGenerator', 'generate', {{'stamps': {str(tmp_path)!r}}})])\n"
            f"print(SERVER.proc.pid, SERVER.dir, flush=True)\n"
            f"import time; time.sleep(600)\n")
    driver = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pid, where = driver.stdout.readline().split()
        server = int(pid)
        assert alive(server) and Path(where).is_dir()
        driver.kill()
        driver.wait(60)
        wait_for(lambda: not alive(server), 120, "the server's end")
        wait_for(lambda: not Path(where).exists(), 30, "its directory's removal")
    finally:
        driver.kill()


RUN = """
import json, os, sys
import ray
from xrlhf.coordinator import Coordinator
from xrlhf.coordinator.forkserver import SERVER
from xrlhf.topology import topology
from xrlhf.validation import validate_dict

model, stamps, fork = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
cfg = validate_dict({
    "name": "fork", "seed": 0, "ray": {"num_cpus": 2, "fork_server": fork, "log_to_driver": False},
    "env": {"name": "reasoning", "options": {"eval_size": 8}},
    "policy": {"model": model, "train": {"lr": 1e-3, "micro_batch_size": 8},
               "generate": {"engine": "%s:RayShyGenerator", "max_new_tokens": 4, "stamps": stamps},
               "resources": {"ranks": 1, "cpus_per_rank": 0.5}},
    "algorithm": {"name": "grpo", "mini_batch_size": 8},
    "trainer": {"steps": 1, "prompts_per_step": 4, "samples_per_prompt": 2},
})
coord = Coordinator(topology(cfg, model, {"policy": 1})).start()
server = SERVER.proc.pid if SERVER.running else None
plain = SERVER.status().get("plain_pid")
rollout, policy = coord.pids["rollout"][0], coord.pids["policy"][0]
def ppid(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().split(")")[-1].split()[1])
worker = coord.handles["rollout"].workers[0]
shy = ray.get(worker.__ray_call__.remote(lambda self: sys.modules["tests.coordinator.ray_shy"].ray is not None))
policy_shy = ray.get(coord.handles["policy"].workers[0].__ray_call__.remote(
    lambda self: "tests.coordinator.ray_shy" in sys.modules))
out = {"server": server, "plain": plain, "rollout": rollout, "rollout_ppid": ppid(rollout), "policy_ppid": ppid(policy),
       "policy_shy": policy_shy,
       "ping": ray.get(worker.ping.remote()), "shy_has_ray": shy, "startup": coord.startup}
coord.shutdown()
out["server_after"] = SERVER.running
print("RESULT " + json.dumps(out), flush=True)
""" % MODULE


@pytest.mark.slow
@pytest.mark.parametrize("fork", [True, pytest.param(False, marks=pytest.mark.long)], ids=["fork_server", "usual"])
def test_a_local_ray_forks_the_preloading_handles_workers(tiny_model, tmp_path, fork):
    """A run's own Ray (a process of its own: pytest's may hold the session's Ray): the generator's
    worker is the fork server's child, built its engine there, and answers calls; the policy's
    worker is its plain copy's child, without the generator's imports; nothing of the server
    outlives the run."""
    stamps = tmp_path / "stamps"
    r = subprocess.run([sys.executable, "-c", RUN, tiny_model, str(stamps), "1" if fork else "0"],
                       capture_output=True, text=True, timeout=600, cwd=str(Path(__file__).parents[2]))
    lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    out = json.loads(lines[-1].removeprefix("RESULT "))
    assert out["ping"] == out["rollout"] and out["server_after"] is False
    assert out["policy_ppid"] != out["server"] and not out["policy_shy"]
    built = {p.name for p in stamps.iterdir()}
    assert f"alone-start-{out['rollout']}" in built
    if fork:
        assert out["server"] and out["rollout_ppid"] == out["server"]
        assert f"preload-{out['server']}" in built, "vLLM's stand-in imported in the server, before Ray's start"
        assert out["shy_has_ray"], "the module that found Ray absent in the server has it in the worker"
        assert out["plain"] and out["policy_ppid"] == out["plain"], "the policy's worker forked from the plain copy"
        times = out["startup"]
        assert times["fork_server/started_s"] < times["fork_server/plain_s"] <= times["fork_server/imported_s"]
        wait_for(lambda: not any(alive(out[k]) for k in ("server", "plain", "rollout")), 60,
                 "the server's, its copy's and the workers' end")
    else:
        assert out["server"] is None and out["plain"] is None and "fork_server/started_s" not in out["startup"]


def test_the_cli_starts_a_server_from_the_raw_config_which_it_validates_itself(tiny_model, tmp_path):
    """``start_early`` (``xrlhf run``'s first step) starts a server only for a config naming an engine
    other than its section's default on a local Ray; the server validates the config, asks the
    classes and preloads what its handles preload (nothing: it ends). Given the start-order config
    (its generator, a user's class, preloads), the server imports it; given vLLM on this CPU machine
    (not installed), the server reports its failure and ends, and a second one is not tried."""
    import yaml

    from xrlhf.coordinator.forkserver import NOTHING, SERVER, start_early

    stamps = tmp_path / "stamps"
    data = {"name": "early", "seed": 0, "ray": {"num_cpus": 2},
            "env": {"name": "reasoning", "options": {"eval_size": 8}},
            "policy": {"model": tiny_model, "train": {"lr": 1e-3, "micro_batch_size": 8},
                       "generate": {"engine": f"{MODULE}:AloneGenerator", "max_new_tokens": 4, "stamps": str(stamps)},
                       "resources": {"ranks": 1, "cpus_per_rank": 0.5}},
            "algorithm": {"name": "grpo", "mini_batch_size": 8},
            "trainer": {"steps": 1, "prompts_per_step": 4, "samples_per_prompt": 2}}
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(data))
    try:
        assert not start_early(str(config), ["policy.generate.engine=hf"])  # nothing preloads: nothing started
        assert not start_early(str(config), ["policy.generate.engine=vllm", "ray.fork_server=false"])
        assert start_early(str(config), [])  # the preloading stand-in, by import path
        wait_for(lambda: SERVER.status(), 180, "the server's imports")
        assert SERVER.status()["usable"] and SERVER.running
        assert (stamps / f"preload-{SERVER.proc.pid}").is_file()
        assert start_early(str(config), ["policy.generate.engine=vllm"])
        wait_for(lambda: SERVER.status(), 180, "the server's imports")
        status = SERVER.status()
        assert not status["usable"] and "vllm" in status["why"] and status["why"] != NOTHING
        SERVER.proc.wait(60)  # it ends: clients find no server and start the usual way
        assert SERVER.runtime_env() is None and SERVER.failed()
        SERVER.start(config={**data, "policy": {**data["policy"], "generate": {"engine": "hf", "max_new_tokens": 4}}})
        wait_for(lambda: SERVER.status(), 180, "the server's imports")
        assert SERVER.status()["why"] == NOTHING and not SERVER.failed()
    finally:
        SERVER.stop()


def test_the_early_start_reads_no_engine_class_and_the_server_asks_them():
    """``start_early`` reads each section's engine with its role and starts a server where one is
    not its section's default, without importing any engine (torch would come first: ~2 s before
    the server could start); the server then asks the classes (``preloads``): vLLM's preloads, the
    Transformers engines and DeepSpeed's do not."""
    import subprocess
    import sys

    from xrlhf.coordinator.forkserver import _engines, _other_engines, preloads

    data = {"policy": {"train": {"engine": "deepspeed"}, "generate": {"engine": "vllm"}},
            "reference": {"infer": {"engine": "hf"}}, "env": {"options": {"engine": "not an engine section"}}}
    assert list(_engines(data)) == [("train", "deepspeed"), ("generate", "vllm"), ("infer", "hf")]
    assert _other_engines(data) == [("train", "deepspeed"), ("generate", "vllm")]
    assert _other_engines({"policy": {"generate": {"engine": "hf"}}, "critic": {"train": {}}}) == []
    light = subprocess.run([sys.executable, "-c", "import sys; from xrlhf.coordinator.forkserver import _other_engines; "
                            "_other_engines({'policy': {'generate': {'engine': 'vllm'}}}); print('torch' in sys.modules)"],
                           capture_output=True, text=True, timeout=300, check=True)
    assert light.stdout.strip() == "False", light.stderr[-2000:]
    assert preloads({"generate": ("vllm", None)}) and not preloads({"generate": ("hf", None)})
    assert preloads({"generate": (f"{MODULE}:AloneGenerator", None)})
    assert not preloads({"train": ("deepspeed", None), "infer": ("hf", None)})
