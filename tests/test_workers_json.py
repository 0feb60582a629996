"""``workers.json`` is replaced whole: a reader beside the rewrites (the healing benchmark's fault
injector) never reads a half-written file (it did once in CI, and a fault was never sent)."""

from __future__ import annotations

import json
import threading

from xrlhf.runner import write_pids


def test_a_reader_beside_the_rewrites_always_reads_a_whole_file(tmp_path):
    pids = {"policy": list(range(1000, 1064)), "rollout": [7]}
    write_pids(tmp_path, pids)
    bad: list[str] = []
    done = threading.Event()

    def read():
        while not done.is_set():
            text = (tmp_path / "workers.json").read_text()
            try:
                json.loads(text)
            except ValueError:
                bad.append(text)

    reader = threading.Thread(target=read)
    reader.start()
    for i in range(300):
        write_pids(tmp_path, {**pids, "rollout": [i]})
    done.set()
    reader.join()
    assert not bad
    assert json.loads((tmp_path / "workers.json").read_text())["rollout"] == [299]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["workers.json"]
