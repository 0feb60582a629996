"""A module that imports Ray if it can, as vLLM's Ray executor does (``vllm/v1/executor/ray_utils.py``):
the fork server holds Ray back while it imports, so the forked worker must import this again."""

try:
    import ray
except ImportError:
    ray = None
