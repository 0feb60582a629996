"""DeepSpeed backend: ZeRO 0-3 training (with CPU offload) and ZeRO-3 partitioned inference.

The model, its forward pass and the LR schedule are the Transformers backend's (``HFModel``,
``lr_lambda``); only the optimizer, the gradient reduction and the parameter layout change.
DeepSpeed is imported only inside the functions that build and run an engine, so validation
reads the options here (``DeepSpeedTrainOptions``, ``DeepSpeedInferOptions``) without DeepSpeed
installed, and a run with ``engine: hf`` never loads it. Importing the package registers
``deepspeed.train`` and ``deepspeed.infer``. Its modules:

* ``options``: the engines' options and the DeepSpeed config made from them (``conflicts``,
  ``merged_config``);
* ``zero``: ``ZeroModel``, the model under a DeepSpeed engine that both engines hold, and the
  bucket-by-bucket ZeRO-3 gather of its weights (``gathered_weights``);
* ``train``, ``infer``: the engines (the train step's contract under DeepSpeed: ``train``).
"""

from xrlhf.engines.deepspeed.infer import DeepSpeedInferEngine
from xrlhf.engines.deepspeed.options import (DERIVED, OWNED, DeepSpeedInferOptions, DeepSpeedTrainOptions, conflicts,
                                             generated_infer_config, generated_train_config, merged_config)
from xrlhf.engines.deepspeed.train import DeepSpeedTrainEngine
from xrlhf.engines.deepspeed.zero import ZeroModel, gathered_weights, init_distributed

__all__ = ["DERIVED", "OWNED", "DeepSpeedInferEngine", "DeepSpeedInferOptions", "DeepSpeedTrainEngine",
           "DeepSpeedTrainOptions", "ZeroModel", "conflicts", "gathered_weights", "generated_infer_config",
           "generated_train_config", "init_distributed", "merged_config"]
