"""Transformers backend: the ``hf`` train, infer and generate engines, on CPU or one GPU.

The registry finds the backend by its name (``ENGINES`` imports ``xrlhf.engines.hf``); importing
the package imports its three engine modules, which register ``hf.train``, ``hf.infer`` and
``hf.generate``. What is here and why it belongs to this backend:

* ``model``: ``HFModel``, a Transformers model with the forward every role needs (logprobs and
  entropy, values or scores of the response part of a batch). The DeepSpeed backend reuses it
  and swaps only the optimizer and the parallelism.
* ``packing``, ``attention``, ``probe``: how ``HFModel`` lays a micro-batch out (packed into one
  row, or padded), the varlen attention function it registers with Transformers'
  ``AttentionInterface``, and the probe that decides, when an engine is built, which layout its
  model can take. All three speak Transformers' model interface, so they live here.
* ``compiling``: ``compile: true``, regional ``torch.compile`` of the model's decoder blocks.
* ``train``, ``infer``, ``generate``: the engines; ``decode``: the generator's keyed decode loop.

Kept outside, because more than this backend uses them: LoRA (``engines/lora.py``: both train
backends wrap their model with PEFT, and the run's set-up reads its options before any backend
loads), the HF model directory on disk (``engines/model_files.py``, which LoRA writes too), what
every train backend shares (``engines/training.py``), and plain torch that any backend may use:
fp32 master weights (``engines/mixed_precision.py``) and token budgets sized for a GPU
(``engines/budget.py``). None of them imports this package, so the imports run one way:
``hf`` -> ``lora`` -> ``model_files``.
"""

from xrlhf.engines.hf.generate import HFGenerateEngine, HFGenerateOptions, load_named_weights
from xrlhf.engines.hf.infer import HFInferEngine, HFInferOptions
from xrlhf.engines.hf.model import DTYPES, HFModel, HFModelOptions, disable_dropout, load_hf_model, token_logprobs
from xrlhf.engines.hf.train import HFTrainEngine, HFTrainOptions
from xrlhf.engines.model_files import copy_tokenizer_files, save_with_tokenizer

__all__ = ["DTYPES", "HFGenerateEngine", "HFGenerateOptions", "HFInferEngine", "HFInferOptions", "HFModel",
           "HFModelOptions", "HFTrainEngine", "HFTrainOptions", "copy_tokenizer_files", "disable_dropout",
           "load_hf_model", "load_named_weights", "save_with_tokenizer", "token_logprobs"]
