"""The co-located weight route's order of calls, against recording stand-ins for the handles
(control flow only: the real route runs in the Ray tests, e.g. test_heal_during_sync.py)."""

from __future__ import annotations

from xrlhf.coordinator.spec import WeightSyncPlan
from xrlhf.coordinator.weight_routes import WeightRoutes


class Sent:
    def __init__(self, calls: list[str], message):
        self.calls, self.refs, self.message = calls, [message], message

    def get(self):
        return self.message


class Policy:
    def __init__(self, calls: list[str], buckets: int):
        self.calls, self.left = calls, buckets

    def release_memory(self):
        self.calls.append("policy.release_memory")

    def begin_send(self):
        self.calls.append("policy.begin_send")

    def next_message(self, wait: bool = True):
        self.calls.append("policy.next_message")
        self.left -= 1
        return Sent(self.calls, f"bucket{self.left}" if self.left >= 0 else None)


class Rollout:
    def __init__(self, calls: list[str]):
        self.calls = calls

    def receive_each(self, refs):
        self.calls.append("rollout.receive_each")
        return [refs[0] is not None]

    def end_sync(self, version):
        self.calls.append(f"rollout.end_sync({version})")


def test_a_colocated_sync_returns_the_trainers_memory_before_anything_wakes_and_again_before_the_kv_cache():
    calls: list[str] = []
    routes = WeightRoutes(WeightSyncPlan("cuda_ipc", {}, colocated=True), Policy(calls, buckets=2), Rollout(calls))
    routes.sync(version=3)
    assert calls == ["policy.release_memory", "policy.begin_send",
                     "policy.next_message", "rollout.receive_each",
                     "policy.next_message", "rollout.receive_each",
                     "policy.next_message", "rollout.receive_each",  # None: the sender has sent all
                     "policy.release_memory", "rollout.end_sync(3)"]
    assert routes.epoch == 1
