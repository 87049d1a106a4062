"""`tiny-llama`: a seeded random Llama-family model with a real (trained) BPE tokenizer, offline.

Tests need a tokenizer with a chat template and special tokens, not just ids; we train a small
byte-level BPE on text that ships with Python so nothing is fetched.
"""

from __future__ import annotations

import hashlib
import json
import pydoc_data.topics
from pathlib import Path

import torch

from specdec.models.cache import build_folder_atomically, cache_root

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _train_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def tiny_folder(seed: int = 0, vocab_size: int = 512, hidden_size: int = 64, num_hidden_layers: int = 2,
                num_attention_heads: int = 4, num_key_value_heads: int = 2, intermediate_size: int = 128,
                model_type: str = "llama", initializer_range: float = 0.2, max_position_embeddings: int = 4096,
                tie_word_embeddings: bool = True, rope_theta: float = 100000.0) -> Path:
    """Build (once) and return the folder of a tiny random model with the given shape and seed."""
    spec = dict(locals())
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]

    def build(tmp: Path) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        _train_tokenizer(tmp, vocab_size)
        shape = {k: v for k, v in spec.items() if k not in ("seed", "model_type")}
        # a non-default rope theta, so a loader that ignores the checkpoint's theta fails the tests
        cfg = AutoConfig.for_model(model_type, bos_token_id=0, eos_token_id=2, pad_token_id=0, **shape)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        model.save_pretrained(tmp, safe_serialization=True)

    return build_folder_atomically(cache_root() / "models" / f"tiny-{model_type}-{key}", build)
