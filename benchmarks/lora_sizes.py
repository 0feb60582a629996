"""What LoRA trains and keeps, on the CPU: trained parameters, gradient and AdamW-state bytes and the
size of a train engine's checkpoint state, full fine-tuning against LoRA (docs/lora.md, "Memory").

Builds the Transformers train engine on a model directory (default: the tiny char model), takes
one SFT step so AdamW has its states, and counts tensors; the adapter count of a larger preset is
computed on the meta device (no weights).

    python -m benchmarks.lora_sizes [--model artifacts/tiny-char] [--preset 0.5b]
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile

import torch


def sizes(model: str, lora: dict | None) -> dict[str, int]:
    """Parameters, trained parameters, gradient / AdamW-state bytes, checkpoint bytes after one step."""
    from xrlhf.algorithms.losses import SFTLoss
    from xrlhf.data.batch import build_sequences
    from xrlhf.data.text import encode_prompt, load_tokenizer
    from xrlhf.engines.base import EngineSpec
    from xrlhf.engines.hf import HFTrainEngine

    tok = load_tokenizer(model)
    batch = build_sequences([encode_prompt(tok, f"{i}+{i}=") for i in range(8)],
                            [tok.encode(str(2 * i), add_special_tokens=False) + [tok.eos_token_id] for i in range(8)],
                            tok.pad_token_id)
    t = HFTrainEngine(EngineSpec(model, options={"lr": 1e-3, "micro_batch_size": 8, **({"lora": lora} if lora else {})},
                                 seed=0))
    t.train_step(batch, SFTLoss())
    trained = sum(p.numel() for p in t.params)
    adam = sum(v.numel() * v.element_size() for s in t.optimizer.state.values() for v in s.values()
               if torch.is_tensor(v) and v.dim() > 0)
    buf = io.BytesIO()
    torch.save(t.state_dict(), buf)
    return {"params": sum(p.numel() for p in t.model.parameters()), "trained": trained,
            "grad_bytes": sum(p.numel() * p.element_size() for p in t.params), "adam_bytes": adam,
            "checkpoint_bytes": buf.tell()}


def preset_adapters(preset: str, rank: int) -> dict[str, int]:
    """Adapter parameters of rank ``rank`` on every linear layer of ``preset``, counted on the meta
    device from a ``config.json`` (no weights, no tokenizer)."""
    from transformers import LlamaConfig

    from xrlhf.engines.lora import LoraOptions, adapter_params
    from xrlhf.models.tiny import PRESETS, preset_params

    p = {"heads": 4, "kv_heads": None, "intermediate": None, **PRESETS[preset]}
    config = LlamaConfig(hidden_size=p["hidden"], num_hidden_layers=p["layers"], num_attention_heads=p["heads"],
                         num_key_value_heads=p["kv_heads"] or p["heads"],
                         intermediate_size=p["intermediate"] or 4 * p["hidden"], vocab_size=p.get("vocab_size", 128))
    with tempfile.TemporaryDirectory() as d:
        config.save_pretrained(d)
        adapters = adapter_params(d, "causal_lm", LoraOptions(rank=rank))
    return {"preset": preset, "rank": rank, "base_params": preset_params(preset), "adapter_params": adapters}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="artifacts/tiny-char")
    p.add_argument("--preset", default="0.5b")
    args = p.parse_args()
    out = {"full": sizes(args.model, None), "lora_r16": sizes(args.model, {"rank": 16, "alpha": 32}),
           "lora_r8": sizes(args.model, {"rank": 8, "alpha": 16}),
           "preset_r16": preset_adapters(args.preset, 16)}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
