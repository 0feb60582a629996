"""The rollout producer's schedule (the synchronous one, k = 0, included), hand-off, idle
generator, checkpoint state and faults, with a stand-in ``collect`` (control flow only; the
real runs are in test_async.py and test_one_path.py)."""

import threading
import time

import pytest

from xrlhf.algorithms.rollout.producer import Producer as RolloutProducer
from xrlhf.config.schema import RolloutConfig
from xrlhf.utils import faults
from xrlhf.utils.bounded import STOPPING, UserCodeAborted, call_bounded
from xrlhf.utils.errors import WorkerDiedError
from xrlhf.utils.seeds import derive_seed, sample_seed, seed_of, turn_seed


class Generator:
    """Records the version the 'generator' held when each batch was generated."""

    def __init__(self, delay: float = 0.0):
        self.version = 0
        self.used: dict[int, int] = {}
        self.delay = delay

    def collect(self, b, pos, on_generated):
        self.used[b] = self.version
        time.sleep(self.delay)
        on_generated()
        return {"batch": b, "pos": pos}, pos + 10


def train(producer, gen, steps, step_s=0.0):
    got = []
    for s in range(1, steps + 1):
        got.append(producer.get(s))
        time.sleep(step_s)
        producer.before_sync(s)
        gen.version = s  # the sync
        producer.after_sync(s)
    return got


@pytest.mark.parametrize("k", [0, 1, 2, 3])
@pytest.mark.parametrize("gen_s,step_s", [(0.0, 0.01), (0.01, 0.0)])
def test_fixed_schedule_generates_batch_b_with_version_b_minus_1_minus_k(k, gen_s, step_s):
    gen = Generator(gen_s)
    p = RolloutProducer(gen.collect, RolloutConfig(max_staleness=k), last=8).start()
    got = train(p, gen, 8, step_s)
    p.stop()
    assert [g["batch"] for g in got] == list(range(1, 9))
    assert [g["pos"] for g in got] == [10 * i for i in range(8)]
    assert gen.used == {b: max(0, b - 1 - k) for b in range(1, 9)}


def test_staleness_0_generates_each_batch_after_the_previous_publish_and_idles_between():
    """The synchronous loop: batch s waits for version s-1, and between a batch and the next sync
    the generator is idle (``on_idle``: a co-located vLLM sleeps) before the trainer gets it."""
    gen, events = Generator(), []
    idle = lambda: events.append(("idle", gen.version)) or {}  # noqa: E731
    p = RolloutProducer(gen.collect, RolloutConfig(max_staleness=0), last=4, on_idle=idle).start()
    for s in range(1, 5):
        got = p.get(s)
        events.append(("got", s))
        assert got["batch"] == s and gen.used[s] == s - 1
        p.before_sync(s)
        gen.version = s
        p.after_sync(s)
    p.stop()
    # idle after every batch (the last: nothing follows it), always before the trainer takes it
    assert events == [("idle", 0), ("got", 1), ("idle", 1), ("got", 2), ("idle", 2), ("got", 3), ("idle", 3),
                      ("got", 4)]


def test_an_evaluation_holds_the_generator_awake_until_released():
    gen, idle = Generator(0.01), []
    p = RolloutProducer(gen.collect, RolloutConfig(max_staleness=0), last=3,
                        on_idle=lambda: idle.append(gen.version) or {"time/sleep_s": 1.0}).start()
    p.get(1)
    p.before_sync(1)
    gen.version = 1
    p.after_sync(1, hold=True)  # the trainer evaluates on the generator after step 1
    time.sleep(0.2)  # meanwhile batch 2 is generated: its idle call must wait for the release
    assert idle == [0]
    p.release()
    assert idle == [0, 1]
    assert p.get(2)["batch"] == 2
    p.release()  # nothing held: no-op
    p.stop()


def test_latest_uses_the_newest_synced_version_within_the_bound():
    gen = Generator(0.005)
    p = RolloutProducer(gen.collect, RolloutConfig(max_staleness=2, freshness="latest"), last=10).start()
    train(p, gen, 10, 0.02)
    p.stop()
    for b, v in gen.used.items():
        assert max(0, b - 1 - 2) <= v <= b - 1


def test_latest_without_in_flight_updates_waits_for_the_generation_under_way():
    started, release = threading.Event(), threading.Event()
    syncing = []

    def collect(b, pos, on_generated):
        if b == 2:
            started.set()
            release.wait(5)
            syncing.append(("generated", b))
        on_generated()
        return b, pos + 1

    p = RolloutProducer(collect, RolloutConfig(max_staleness=1, freshness="latest"), last=2).start()
    assert p.get(1) == 1
    started.wait(5)
    threading.Timer(0.2, release.set).start()
    p.before_sync(1)
    syncing.append(("sync", 1))
    p.after_sync(1)
    assert syncing == [("generated", 2), ("sync", 1)]
    p.stop()


def test_state_dict_waits_for_the_queue_and_resumes_where_it_stopped():
    gen = Generator(0.01)
    p = RolloutProducer(gen.collect, RolloutConfig(max_staleness=2), last=6).start()
    for s in (1, 2):
        p.get(s)
        p.before_sync(s)
        gen.version = s
        p.after_sync(s)
    state = p.state_dict(2)
    p.stop()
    assert sorted(state["queue"]) == [3, 4] and state["next"] == 5 and state["data_pos"] == 40
    # resume: a new producer from the state generates the rest with the same versions
    gen2 = Generator()
    gen2.version = 2
    q = RolloutProducer(gen2.collect, RolloutConfig(max_staleness=2), last=6, start=state["next"],
                        data_pos=state["data_pos"], synced=2, queue=state["queue"]).start()
    for s in range(3, 7):
        assert q.get(s)["batch"] == s
        q.before_sync(s)
        gen2.version = s
        q.after_sync(s)
    q.stop()
    assert gen2.used == {5: 2, 6: 3}


@pytest.fixture()
def stopping():
    """``STOPPING`` set (by the test) and cleared after it."""
    yield STOPPING
    STOPPING.clear()


def test_a_stopping_run_keeps_the_queued_batches_and_gives_up_on_the_held_up_one(stopping):
    """Two steps off, batch 3's episodes wait on a tool that never answers: once the run stops,
    step 1's sync (which waits for batch 3) is given up, the checkpoint after step 1 keeps batch 2
    (queued) and says batch 3 comes next from batch 2's data position, and a wait for batch 3
    ends (``UserCodeAborted``), which is no failure for other threads (nothing through ``faults``)."""
    stuck = threading.Event()

    def collect(b, pos, on_generated):
        if b == 3:  # an env's step calling a tool stuck in run(): bounded, with a time-out of 50 s
            call_bounded(stuck.wait, 50, "env E: Episode.step")
        on_generated()
        return {"batch": b}, pos + 10

    p = RolloutProducer(collect, RolloutConfig(max_staleness=2), last=6).start()
    assert p.get(1)["batch"] == 1
    stopping.set_after(0.3)
    t0 = time.monotonic()
    with pytest.raises(UserCodeAborted, match="rollout: waiting for the generation of batch 3"):
        p.before_sync(1)
    state = p.state_dict(1)  # would wait for batch 3
    assert time.monotonic() - t0 < 5
    assert sorted(state["queue"]) == [2] and state["next"] == 3 and state["data_pos"] == 20
    assert p.get(2)["batch"] == 2  # queued: still handed over
    with pytest.raises(UserCodeAborted, match="abandoned"):  # the episode's, or the wait's own
        p.get(3)
    faults.check()  # nothing reported: a handle's call under way is not broken off
    p.stop(timeout=0.1)
    stuck.set()  # the abandoned call's thread ends: no later test sees it listed


def test_a_stopping_run_gives_up_waiting_for_the_generation_before_a_sync(stopping):
    """One step off, batch 2 never finishes (no user code: a long generate call): once the run
    stops, ``before_sync(1)`` gives up instead of waiting for it."""
    def collect(b, pos, on_generated):
        if b == 2:
            time.sleep(5)
        return {"batch": b}, pos + 10

    p = RolloutProducer(collect, RolloutConfig(max_staleness=1), last=3).start()
    p.get(1)
    stopping.set_after(0.2)
    with pytest.raises(UserCodeAborted, match="rollout: waiting for the generation of batch 2"):
        p.before_sync(1)
    p.stop(timeout=0.1)


def test_a_failing_collect_raises_in_the_trainer_and_through_faults():
    def collect(b, pos, on_generated):
        raise WorkerDiedError("rollout rank 0 died: killed")

    p = RolloutProducer(collect, RolloutConfig(max_staleness=1), last=3).start()
    with pytest.raises(WorkerDiedError, match="rollout rank 0 died"):
        p.get(1)
    with pytest.raises(WorkerDiedError):
        faults.check()  # what a handle waiting on another model calls
    p.stop()
    faults.check()  # cleared


def test_a_silent_generator_is_reported_after_the_stall_timeout():
    def collect(b, pos, on_generated):
        time.sleep(5)
        return b, pos

    p = RolloutProducer(collect, RolloutConfig(max_staleness=1, stall_timeout_s=0.3), last=2).start()
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError, match="stall_timeout_s"):
        p.get(1)
    assert time.monotonic() - t0 < 4.5  # not the collector's 5 s
    p.stop(timeout=0.1)


def test_sample_seeds_are_distinct_and_63_bit():
    seeds = {sample_seed(0, b, r, a) for b in range(-1, 20) for r in range(64) for a in range(2)}
    assert len(seeds) == 21 * 64 * 2 and all(0 <= s < 2**63 for s in seeds)
    assert sample_seed(1, 1, 0) != sample_seed(0, 1, 0)


def test_every_kind_of_seed_comes_from_one_hash_with_its_own_tag():
    s = sample_seed(7, 3, 5)
    assert turn_seed(s, 0) == s and derive_seed(s, 0) == s  # the first turn and first try: the sample's own
    derived = {turn_seed(s, t) for t in range(1, 50)} | {derive_seed(s, a) for a in range(1, 50)}
    assert len(derived) == 98 and s not in derived
    assert seed_of(1, 2) != seed_of(2, 1) and seed_of(-1) == seed_of(-1) and 0 <= seed_of(-1) < 2**63
