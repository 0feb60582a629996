"""Environments: prompt streams, held-out splits and rule rewards behind one small protocol.

``build_env(name, options, seed)`` is how the trainer gets one; ``name`` is a registered name
(``reasoning``, ``qa``, ...) or an import path ``pkg.module:Class``. See :mod:`xrlhf.envs.base`.
"""

from xrlhf.envs.base import ENVS, Env, EnvOptions, Prompt, Score, build_env, clean_response, register_env
from xrlhf.envs import calc, dataset, multiturn, qa, reasoning  # noqa: F401  (register the built-in envs)
from xrlhf.envs.reasoning import ReasoningEnv

__all__ = ["ENVS", "Env", "EnvOptions", "Prompt", "Score", "build_env", "clean_response",
           "register_env", "ReasoningEnv"]
