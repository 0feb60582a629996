"""Refill policies: which generated groups a batch keeps, and how many prompts to generate next.

A batch needs ``trainer.prompts_per_step`` groups. The collector generates them in rounds; after
each round the policy says which groups to keep and how many prompts the next round generates
(0: the batch is done), and at the end how the batch is completed. ``none`` keeps every group
of one round; ``dynamic_sampling`` (DAPO) drops groups that teach the algorithm nothing. A new
policy is one file in this package that registers a ``Refill`` subclass (or any class named by
import path in ``rollout.refill.name``); its options are the flat keys of ``rollout.refill``,
validated by its ``Options`` before the run starts.
"""

from xrlhf.algorithms.rollout.refill.base import REFILLS, GroupFilter, KeepAll, Refill, build_refill, refill_errors

__all__ = ["REFILLS", "GroupFilter", "KeepAll", "Refill", "build_refill", "refill_errors"]
