"""The fork server: workers that begin with their imports done (``ray.fork_server``).

Why: a worker's imports (torch, transformers, vLLM) cannot begin before its process exists, nor
that process before Ray, so they ran in a row with Ray's start. The driver starts a plain process
first, this module's ``serve``, which imports what the preloading engines import
(``Engine.preload``) while Ray starts; Ray then starts such a handle's workers through
``fork_client.py`` (the actor's ``runtime_env`` ``py_executable``) and the server forks them.
The other handles' workers (the trainers) are forked from a copy made before vLLM's import
(``plain``), since vLLM's import patches torch's compiler, which a trainer must not inherit.

Ray itself stays out of the server (its C++ core reads settings from the environment once, so a
worker forked from a process that imported Ray fails), and the server refuses to fork once CUDA was
touched. Only a local Ray on Linux uses it. How it works and what it saves: docs/architecture.md
("The fork server").
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import pickle
import runpy
import selectors
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from xrlhf import internals
from xrlhf.internals.process import FORK_SERVER, NoImport, cuda_touched, die_with_parent, reimport, run_exit_handlers

CLIENT = str(Path(__file__).with_name("fork_client.py"))
ENGINES, SOCKET, PLAIN_SOCKET, LOG, STATUS = "engines.pkl", "s", "p", "server.log", "status.json"
NOTHING = "no engine of the run imports anything at preload"
FORKED_ENV = "XRLHF_FORKED_FROM"
"""Set in a forked worker's environment: the fork server's pid (how a process tells it was forked)."""


def base_worker_env() -> dict[str, str]:
    """What a local Ray's workers (and the fork server) get in their environment beside the driver's:
    the driver's import path, quiet model loads (xrlhf says what it loads), no hub, the hooks' switches."""
    path = os.pathsep.join([os.getcwd()] + [p for p in sys.path if p and os.path.isdir(p)])
    return {"PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1", **internals.switches()}


def preloads(engines: dict[str, tuple[str, Any]]) -> bool:
    """Whether any engine of ``engines`` (role -> (name, spec)) imports something at ``preload`` (vLLM)."""
    from xrlhf.engines.base import Engine, engine_class

    base = Engine.preload.__func__  # type: ignore[attr-defined]
    return any(engine_class(name, role).preload.__func__ is not base for role, (name, _) in engines.items())


def fork_plan(specs: list) -> dict[str, list[tuple[str, str, Any]]]:
    """What a fork server imports for the handles ``specs`` (``HandleSpec``): ``long``, (name, role,
    options) of the engines of the handles that preload (vLLM), forked from the server; ``plain``,
    (name, role, spec) of every other handle's engines, forked from its copy made before the long
    imports. Empty where nothing preloads: no server then (the trainers alone gain ~2 s at most)."""
    engines = [(preloads(s.engines), name, role, spec) for s in specs for role, (name, spec) in s.engines.items()]
    if not any(long for long, *_ in engines):
        return {}
    return {"long": [(name, role, spec.options) for long, name, role, spec in engines if long],
            "plain": [(name, role, spec) for long, name, role, spec in engines if not long]}


def start_early(config: str, overrides: list[str]) -> bool:
    """``xrlhf run``'s first step: where the config names an engine other than its section's default
    for a local Ray, start the fork server before this process imports or validates anything (the
    driver's own imports take seconds before its Ray starts). The server validates the config
    itself, asks the engines' classes whether they preload (``Engine.preload``: vLLM's do) and
    imports what its handles need (``fork_plan``); where none preloads it ends at once ("nothing to
    preload"). Asking the classes here would import torch first (their modules'), and the server
    would start that much later. Anything unclear (a config that does not read) starts nothing:
    the run says why, and ``coordinator.init_ray`` starts a server from the validated topology just
    before Ray."""
    from xrlhf.config.loader import apply_overrides, read_yaml

    try:
        data = apply_overrides(read_yaml(config), list(overrides))
    except Exception:  # noqa: BLE001 - the validation reports it
        return False
    ray_cfg = data.get("ray") if isinstance(data.get("ray"), dict) else {}
    if ray_cfg.get("fork_server") is False or ray_cfg.get("address") or not fork_server_works():
        return False
    if not _other_engines(data):  # the sections' defaults: the Transformers engines, which import at build
        return False
    data.setdefault("name", Path(config).stem)
    with environ(base_worker_env()):
        SERVER.start(config=data)
    return SERVER.running


@contextmanager
def environ(env: dict[str, str]) -> Iterator[None]:
    """Within the block, this process's environment has ``env`` set (what the processes it starts inherit)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _engines(node: Any, key: str | None = None) -> Iterator[tuple[str, str]]:
    """``(role, engine)`` for every ``engine`` value in a config dict, at any depth, whose section
    names its role (``policy.generate.engine``: ``generate``)."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "engine" and isinstance(v, str):
                if key in ("train", "infer", "generate"):
                    yield key, v
            else:
                yield from _engines(v, k)


def _other_engines(data: dict) -> list[tuple[str, str]]:
    """``(role, engine)`` of the sections of config dict ``data`` that name an engine other than
    their section's default (the schema's, read without importing any engine)."""
    from xrlhf.config.schema import GenerateConfig, InferConfig, TrainConfig

    default = {role: cls.model_fields["engine"].default
               for role, cls in (("train", TrainConfig), ("infer", InferConfig), ("generate", GenerateConfig))}
    return [(role, name) for role, name in _engines(data) if name != default[role]]


def fork_server_works() -> bool:
    """Whether the fork server may run here: its hook is on (``internals.process.FORK_SERVER``: Linux)
    and file descriptors pass over a Unix socket."""
    return hasattr(socket, "send_fds") and FORK_SERVER.active()


class ForkServer:
    """The driver's side: starts the server process, names the ``runtime_env`` of the workers it
    forks, stops it. One per local Ray (``coordinator.init_ray`` / ``shutdown_ray``)."""

    def __init__(self):
        self.dir: Path | None = None
        self.proc: subprocess.Popen | None = None
        self.started_at: float | None = None
        self._atexit = False

    def start(self, engines: dict | list[tuple[str, str, Any]] | None = None, config: dict | None = None,
              resolver: str = "xrlhf.runner:fork_plan") -> None:
        """Start importing what ``engines`` need (a ``fork_plan``, or a list: its ``long`` part
        alone), or what the run of ``config`` (a config dict) needs by ``resolver``
        ("module:function" of the layer above returning its ``fork_plan``, called there with the
        dict), in a new process that inherits this one's environment (start it where Ray's workers
        would see the same). Returns at once; the server's sockets exist when this returns."""
        self.stop()
        if not self._atexit:  # a driver that ends early (a config error after start_early) leaves nothing
            atexit.register(self.stop)
            self._atexit = True
        self.dir = Path(tempfile.mkdtemp(prefix="xrlhf-fork-"))
        plan = {"long": list(engines or [])} if isinstance(engines, list) else engines
        what = ("config", (config, resolver)) if config is not None else ("engines", plan)
        (self.dir / ENGINES).write_bytes(pickle.dumps(what))
        self.started_at = time.time()
        with open(self.dir / LOG, "wb") as log:
            # its own session: a Ctrl-C in the terminal reaches the driver, which stops the run;
            # the workers forked from here must not get it beside
            self.proc = subprocess.Popen([sys.executable, "-m", "xrlhf.coordinator.forkserver", str(self.dir)],
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.time() + 60
        while not (self.dir / PLAIN_SOCKET).exists():  # both bound (this one last) before the imports: ~0.1 s
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                return
            time.sleep(0.01)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def runtime_env(self, long: bool = True) -> dict[str, str] | None:
        """The ``runtime_env`` of a worker to fork (``None``: no server, start the usual way): one
        of a preloading handle (``long``) from the server, any other from its plain copy."""
        if not self.running:
            return None
        where = self.dir / (SOCKET if long else PLAIN_SOCKET)
        client = " ".join(shlex.quote(p) for p in (sys.executable, "-I", "-S", CLIENT, str(where)))
        return {"py_executable": client}

    def status(self) -> dict[str, Any]:
        """What the server wrote once its imports ended (``imported_at``, ``usable``, ``why``), or {}."""
        try:
            return json.loads((self.dir / STATUS).read_text()) if self.dir else {}
        except (OSError, ValueError):
            return {}

    def failed(self) -> bool:
        """Whether the last server could not serve (its imports failed, or CUDA was touched): a
        second would fail alike. "Nothing to preload" is no failure."""
        status = self.status()
        return bool(status) and not status.get("usable") and status.get("why") != NOTHING

    def stop(self) -> None:
        """Stop the server (the workers it forked are Ray's, and stay), remove its directory."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            self.proc = None
        self.started_at = None
        if self.dir is not None:
            for p in sorted(self.dir.iterdir(), reverse=True) if self.dir.exists() else []:
                p.unlink(missing_ok=True)
            try:
                self.dir.rmdir()
            except OSError:
                pass
            self.dir = None


SERVER = ForkServer()


# -- the server process -------------------------------------------------------------------------
def _no_ray() -> NoImport:
    """While the server imports, ``import ray`` fails as if Ray were absent (the module docstring)."""
    return NoImport("ray", "held back in xrlhf's fork server")


def _plan(path: Path) -> dict[str, list]:
    """The fork plan pickled at ``path`` (``fork_plan``'s), or the one its config resolves to."""
    kind, what = pickle.loads(path.read_bytes())  # options: the engines' modules
    if kind == "config":  # (config dict, "module:function" returning its fork plan)
        module, function = what[1].split(":")
        return getattr(importlib.import_module(module), function)(what[0]) or {}
    return what or {}


def _imports(path: Path) -> tuple[dict[str, list], list[str], str | None]:
    """The plain stage: import what any worker imports (its class's modules, torch with them), read
    the plan at ``path``, and import what each plain engine's build will (``Engine.fork_imports``).
    Returns the plan, the modules that tried to import Ray and why a fork would not do (``None``)."""
    import gc

    gc.freeze()  # as EngineWorker does: the collections of the imports below skip torch's heap
    # torch.cuda.is_available() by NVML, as vLLM's import sets it for itself: an import that asks
    # (torch's compiler's) does not initialise CUDA, which no fork could use then
    with _no_ray() as no_ray, environ({"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}):
        try:
            import xrlhf.engines.host  # noqa: F401 - the worker's class's modules, torch with them
            from xrlhf.engines.base import engine_class

            plan = _plan(path)
            if not plan.get("long"):
                return plan, no_ray.tried, NOTHING
            for name, role, spec in plan.get("plain", []):
                try:
                    engine_class(name, role).fork_imports(spec)
                except Exception:  # noqa: BLE001 - the build reports it with its context
                    pass
        except Exception:  # noqa: BLE001 - reported; every client then starts the usual way
            return {}, no_ray.tried, "importing failed:\n" + traceback.format_exc()
    return plan, no_ray.tried, cuda_touched()


def _preload(plan: dict[str, list]) -> tuple[list[str], str | None]:
    """The long stage: each preloading engine's ``preload`` (vLLM's import). Returns the modules
    that tried to import Ray and why a fork would not do (``None``: it would)."""
    import gc

    from xrlhf.engines.base import engine_class

    with _no_ray() as no_ray:
        try:
            for name, role, options in plan["long"]:
                engine_class(name, role).preload(options)
        except Exception:  # noqa: BLE001 - reported; every client then starts the usual way
            return no_ray.tried, "importing failed:\n" + traceback.format_exc()
    gc.collect()
    gc.freeze()
    return no_ray.tried, cuda_touched()


def _read_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    msg, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    if len(msg) < 4:
        raise ConnectionError("short request")
    size = struct.unpack("!I", msg[:4])[0]
    body = msg[4:]
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ConnectionError("request cut off")
        body += chunk
    return json.loads(body), fds


def _send(conn: socket.socket, obj: dict[str, Any]) -> None:
    try:
        conn.sendall(json.dumps(obj).encode() + b"\n")
    except OSError:
        pass


def _child(request: dict[str, Any], fds: list[int], closing: list, env_delta: dict[str, str | None],
           retry: list[str]) -> None:
    """In the forked child: become Ray's worker as the raylet asked (its environment, directory,
    streams and command line), with Ray whole again; never returns."""
    code = 1
    try:
        for s in closing:
            s.close()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        for i, fd in enumerate(fds[:3]):
            os.dup2(fd, i)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        env = dict(request["env"])
        for k, v in env_delta.items():  # what the imports set (vLLM's variables), as in a worker that imported them
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        env[FORKED_ENV] = str(os.getppid())
        os.environ.clear()
        os.environ.update(env)
        os.chdir(request["cwd"])
        argv = request["argv"]
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))  # as `python <script>` would
        reimport(retry)  # modules that found Ray absent in the server: imported again, with Ray
        runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - the worker's own error, to its stderr (Ray's log)
        traceback.print_exc()
    finally:
        try:
            run_exit_handlers()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # noqa: BLE001
                    pass
            os._exit(code)


def serve(directory: str) -> None:
    """The server's process: bind, import, then fork a worker for each client until stopped; a
    server whose driver died (not stopped by it) removes its directory itself."""
    die_with_parent()
    driver = os.getppid()
    try:
        _serve(Path(directory), driver)
    finally:
        if os.getppid() != driver:
            shutil.rmtree(directory, ignore_errors=True)


def _listen(path: Path) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(64)  # clients that come before the imports end wait in the backlog
    return listener


def _env_delta(base: dict[str, str]) -> dict[str, str | None]:
    """What this process's imports changed in its environment since ``base`` (``None``: removed)."""
    delta: dict[str, str | None] = {k: v for k, v in os.environ.items() if base.get(k) != v}
    delta.update({k: None for k in base if k not in os.environ})
    return delta


def _serve(root: Path, driver: int) -> None:
    """Bind both sockets; the plain stage, then its copy that serves the plain socket; the long
    stage, then serve the other. A server that cannot serve ends, and its copy with it: every
    client then starts the usual way."""
    listener, plain = _listen(root / SOCKET), _listen(root / PLAIN_SOCKET)
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    base = dict(os.environ)
    t0 = time.time()
    plan, retry, why = _imports(root / ENGINES)
    status: dict[str, Any] = {"plain_at": time.time(), "plain_why": why, "pid": os.getpid()}
    if why is None and plan.get("plain"):
        pid = os.fork()
        if pid == 0:  # the plain copy: serves the plain socket, ends with the server
            die_with_parent()
            listener.close()
            code = 1
            try:
                _loop(plain, _env_delta(base), retry, stop, os.getppid())
                code = 0
            finally:
                os._exit(code)
        status["plain_pid"] = pid
    plain.close()
    if plan.get("long") and why != NOTHING:  # a copy that could not be made costs the long stage nothing
        retry_long, why = _preload(plan)
        retry = retry + [m for m in retry_long if m not in retry]
    status.update({"imported_at": time.time(), "import_s": round(time.time() - t0, 2), "usable": why is None,
                   "why": why, "retry": retry})
    (root / STATUS).write_text(json.dumps(status))
    print(f"fork server {os.getpid()}: imports {status['import_s']} s, usable {why is None}"
          + (f" ({why})" if why else "") + (f"; Ray held back from {retry}" if retry else "")
          + (f"; plain copy {status['plain_pid']}" if "plain_pid" in status else ""), flush=True)
    if why is not None:  # its clients find no server and start the usual way
        listener.close()
        if "plain_pid" in status:
            os.kill(status["plain_pid"], signal.SIGTERM)
            os.waitpid(status["plain_pid"], 0)
        return
    _loop(listener, _env_delta(base), retry, stop, driver)


def _loop(listener: socket.socket, env_delta: dict[str, str | None], retry: list[str], stop: list[int],
          parent: int) -> None:
    """Fork a worker for each client of ``listener`` until stopped or ``parent`` is gone; a client
    whose connection closes (it died) takes its child along."""
    children: dict[int, socket.socket] = {}
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    while not stop and os.getppid() == parent:
        for key, _ in sel.select(timeout=0.2):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                try:
                    request, fds = _read_request(conn)
                except (OSError, ValueError, ConnectionError) as e:
                    _send(conn, {"exec": f"bad request: {e}"})
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:  # the child keeps no socket of the server's (a client sees the server's end)
                    _child(request, fds, [listener, conn, *children.values()], env_delta, retry)
                for fd in fds:
                    os.close(fd)
                children[pid] = conn
                sel.register(conn, selectors.EVENT_READ, pid)
                _send(conn, {"pid": pid})
            else:  # a client's connection: readable means closed (the client died): its child goes too
                try:
                    gone = not key.fileobj.recv(1)
                except OSError:
                    gone = True
                if gone:
                    sel.unregister(key.fileobj)
                    try:
                        os.kill(key.data, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        _reap(children, sel)
    listener.close()


def _reap(children: dict[int, socket.socket], sel: selectors.BaseSelector) -> None:
    """Tell each ended child's client how it ended."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
        try:
            sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
