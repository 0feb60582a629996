"""Shared fixtures: a tiny model built locally once per session, Ray for the tests that ask for it;
GPU tests skipped on CPU."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Ray's start-up on a loaded machine: its default waits for the GCS (30 s for the cluster id, 5 s
# per connection) ran out on a busy 2-core box ("Timed out while waiting for GCS to become
# available"). Read by every Ray process these tests start, in-process or in a subprocess run.
RAY_STARTUP_ENV = {"RAY_py_gcs_connect_timeout_s": "180", "RAY_gcs_server_port_wait_time_s": "180",
                   "RAY_gcs_rpc_server_connect_timeout_s": "60"}
for _key, _value in RAY_STARTUP_ENV.items():
    os.environ.setdefault(_key, _value)


def pytest_collection_modifyitems(config, items):
    import torch

    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        # `make test-quick` leaves out what takes minutes: the end-to-end runs, every test that starts
        # Ray (the ray_session fixture: a Ray start-up, then handles in Ray workers), and what is
        # marked slow by hand
        if "e2e" in item.path.parts or "ray_session" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
        if "gpu" in item.keywords and n_gpus == 0:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        marker = item.get_closest_marker("gpus")
        if marker is not None and n_gpus < marker.args[0]:
            item.add_marker(pytest.mark.skip(reason=f"needs {marker.args[0]} GPUs, found {n_gpus}"))


def start_ray(options, attempts: int = 3) -> None:
    """``init_ray(options)`` (the ``ray`` section), tried again after a failed start (a loaded machine can still miss
    Ray's start-up deadlines, raised to minutes above)."""
    import time

    import ray

    from xrlhf.coordinator.coordinator import init_ray

    for attempt in range(1, attempts + 1):
        try:
            init_ray(options)
            return
        except Exception:  # noqa: BLE001 - Ray raises RuntimeError, ConnectionError, TimeoutError ...
            ray.shutdown()
            if attempt == attempts:
                raise
            time.sleep(5 * attempt)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the tests that run handles in this process (they reuse it, as in a
    notebook). Opt in with ``pytestmark = pytest.mark.usefixtures("ray_session")`` or the
    argument; every other test runs without Ray, and subprocess runs start their own."""
    from types import SimpleNamespace


    from xrlhf.coordinator.coordinator import shutdown_ray

    start_ray(SimpleNamespace(address=None, num_cpus=2, num_gpus=None, log_to_driver=False))
    yield
    shutdown_ray()


def forget_deepspeed_groups() -> None:
    """DeepSpeed caches the communication backend and a clone of the world group
    (``groups._WORLD_GROUP``); once a module's one-rank group is destroyed that clone is stale, and
    the next ``deepspeed.initialize`` fails on it ("Group ... is not registered") or not, by the
    order the modules ran in."""
    from deepspeed import comm
    from deepspeed.utils import groups

    comm.comm.cdb = None
    groups._WORLD_GROUP = None


@pytest.fixture(scope="module")
def one_rank():
    """A one-rank process group for in-process DeepSpeed engines (made by the first one), torn
    down after the module, DeepSpeed's caches of it forgotten before and after."""
    pytest.importorskip("deepspeed")
    import torch.distributed as dist

    had_local_rank = "LOCAL_RANK" in os.environ
    if not dist.is_initialized():
        forget_deepspeed_groups()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    forget_deepspeed_groups()
    if not had_local_rank:
        os.environ.pop("LOCAL_RANK", None)


@pytest.fixture(autouse=True)
def _loguru_sink_back():
    """``xrlhf.cli.main`` called in pytest's process swaps loguru's sinks for one on the
    ``sys.stderr`` of that moment, pytest's capture, closed once the test ends: every later log line
    then printed a "Logging error" block. After each test, one sink on the real stderr again."""
    import sys

    from loguru import logger

    yield
    logger.remove()
    logger.add(sys.__stderr__, level="DEBUG")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A 2-layer, 64-wide Llama with a char tokenizer (about 140k parameters)."""
    from xrlhf.models.tiny import build_model

    return str(build_model(tmp_path_factory.mktemp("models") / "tiny", seed=0))


@pytest.fixture()
def base_config(tiny_model) -> dict:
    """A small valid PPO config dict on the reasoning env (no warm-up)."""
    return {
        "name": "test",
        "seed": 0,
        "ray": {"num_cpus": 2},
        "env": {"name": "reasoning", "options": {"eval_size": 16}},
        "policy": {"model": tiny_model, "train": {"lr": 1e-3, "micro_batch_size": 8},
                   "generate": {"max_new_tokens": 4}, "resources": {"ranks": 2}},
        "critic": {"train": {"lr": 1e-3, "micro_batch_size": 8}},
        "reference": {},
        "algorithm": {"name": "ppo", "mini_batch_size": 8, "kl_coef": 0.05},
        "trainer": {"steps": 2, "prompts_per_step": 16},
    }


@pytest.fixture()
def restore_environ():
    """``xrlhf.cli.main`` sets the variables a run needs (``HF_HUB_OFFLINE`` ...) in its process: a
    test that calls it in pytest's own puts them back, so no later test sees them (one that
    compares this process's variables failed so)."""
    from unittest import mock

    with mock.patch.dict("os.environ"):
        yield


def two_ranks(config: dict) -> dict:
    """``config`` with two policy ranks (and two co-located generators): for the end-to-end tests
    whose point they are (``tests/e2e/conftest.py`` gives the others one)."""
    config["policy"] = {**config["policy"], "resources": {"ranks": 2}}
    return config


def build_gpt2(out_dir, *, positions: int = 64, dropout: float = 0.1) -> str:
    """A 2-layer, 32-wide GPT-2 (learned positions, dropout as GPT-2's defaults have it) with the
    char tokenizer, saved like a hub checkpoint: another architecture than the tiny Llama."""
    from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel

    from xrlhf.models.tiny import build_tokenizer

    tok = build_tokenizer("char")
    config = GPT2Config(vocab_size=128, n_positions=positions, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    import torch

    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return str(out_dir)


def policy_batch(tok, n: int = 4):
    """``n`` rows ``"i+i=" -> 2i`` with old logprobs of -1 and advantages from -1 to 1: a train
    step's batch for a handle test (``input_ids [n, P+R]``, the masks and per-token tensors)."""
    import torch

    from xrlhf.data.batch import build_sequences
    from xrlhf.data.text import encode_prompt

    prompts = [encode_prompt(tok, f"{i}+{i}=") for i in range(n)]
    b = build_sequences(prompts, [tok.encode(str(2 * i), add_special_tokens=False) for i in range(n)],
                        tok.pad_token_id)
    b["old_logprobs"] = -torch.ones(b["response_mask"].shape) * b["response_mask"]
    b["advantages"] = torch.linspace(-1, 1, n)[:, None] * b["response_mask"]
    return b


_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the test process with pytest's own status once its report is written. The whole suite's
    interpreter crashed with SIGSEGV in its final clean-up after every test had passed (CI,
    2026-11-25: 808 passed, then ``make: Segmentation fault``), in C extensions' exit handlers
    (Ray, torch, wandb are all loaded by then); the tests' results are already final there.
    ``XRLHF_TEST_CLEAN_EXIT=0`` lets the interpreter finish normally (to chase that crash)."""
    # not in a pytest-xdist worker: it reports to the main process while it shuts down
    if _EXIT_STATUS and os.environ.get("XRLHF_TEST_CLEAN_EXIT", "1") == "1" and "PYTEST_XDIST_WORKER" not in os.environ:
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1])
