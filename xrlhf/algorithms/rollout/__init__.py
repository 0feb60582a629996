"""The one rollout path: every batch of every schedule is built by one ``Collector`` and handed
to the trainer by one ``Producer``.

::

    Producer (a thread of the driver)                 the trainer (RLTrainer.step)
      batch b waits for version need(b) = b-1-k         rollout = producer.get(s)
      Collector(b, data position):                      update(rollout)             (infer, train)
        rounds of prompts <- refill policy              producer.before_sync(s)
        sampler: SingleTurn | Episodes                  handles.sync_weights(version=s)
          generate (per-sample seeds), score            producer.after_sync(s)
        assemble -> Rollout
      generator idle until the next sync: end_rollout

``rollout.max_staleness`` ``k = 0`` is the synchronous loop (the producer waits for every
publish), ``k >= 1`` the asynchronous one. Modules: ``types`` (``Rollout``, ``Group``,
``sampling_params``), ``single_turn`` and ``episodes`` (the samplers), ``refill/`` (which
groups a batch keeps: ``none``, ``dynamic_sampling``, or a file of your own), ``collector``,
``producer``, ``evaluate`` (held-out prompts, seeded like a batch).
"""

from xrlhf.algorithms.rollout.collector import Collector
from xrlhf.algorithms.rollout.producer import Producer
from xrlhf.algorithms.rollout.types import Group, Rollout, Sampling, sampling_params

__all__ = ["Collector", "Group", "Producer", "Rollout", "Sampling", "sampling_params"]
