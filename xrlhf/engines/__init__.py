"""Engine layer: one model shard on one device, for training, inference or generation.

Never imports Ray. Backends: ``hf`` (Transformers; train, infer, generate), ``deepspeed``
(train, infer) and ``vllm`` (generate), the last two imported only when chosen.
"""
