"""What the GPU check's cases share: its options, the models they build once (tiny ones per dtype and
compilation, the random big one in Llama-3-8B's shape) and the reference outputs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdec.models.loader import LoadedModel, load_model
from specdec.strategies.base import GenerationParams

# Llama-3-8B's shape (bf16: about 16 GB of weights); "tiny" keeps the speed cases runnable on a CPU
SHAPES: dict[str, dict[str, Any]] = {
    "8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 128256, "rope_theta": 500000.0, "max_position_embeddings": 8192,
           "rms_norm_eps": 1e-5},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 512, "rope_theta": 10000.0, "max_position_embeddings": 4096},
}
# the random draft model of the drafting-cost cases: a small Llama on the target's vocabulary
DRAFT_SHAPES: dict[str, dict[str, Any]] = {
    "8b": {**SHAPES["8b"], "hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": 2,
           "num_attention_heads": 8, "num_key_value_heads": 8},
    "tiny": {**SHAPES["tiny"], "num_hidden_layers": 1},
}
MAX_LEN = 512  # the tiny model's cache: prompts of ~30 tokens plus the checked output


@dataclass
class Options:
    device: str = "cuda"
    shape: str = "8b"
    out: Path = Path("experiments/gpu")
    check_tokens: int = 32  # tokens per correctness turn
    check_prompts: int = 4
    new_tokens: int = 64  # tokens per speed turn
    rounds: int = 1
    speed_prompts: int = 2
    context: int = 256  # cached tokens before each verification pass, and the speed prompts' length
    ks: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    reps: int = 5
    batches: list[int] = field(default_factory=lambda: [1, 4, 16])  # slots of the batched speed cases
    samples: int = 2000  # draws per chi-square test
    sampling_seed: int = 1234  # the chi-square tests' generator
    budget_s: float = 440.0
    case_timeout_s: float = 240.0  # speed/decode/greedy_compiled took 179 s on an H200 (compiling every bucket)
    compiled_strategies: tuple[str, ...] | None = None  # None: every strategy
    cases: tuple[str, ...] = ()  # fnmatch patterns of the cases to run; empty: every case
    skip: tuple[str, ...] = ()  # fnmatch patterns of cases to leave out



class Models:
    """What the cases share: tiny models per (dtype, compiled), reference outputs, the random big model."""

    def __init__(self, opt: Options) -> None:
        self.opt = opt
        self.dev = torch.device(opt.device)
        self._memo: dict[Any, Any] = {}

    def memo(self, key: Any, build: Callable[[], Any]) -> Any:
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def tiny(self, dtype: str, compiled: bool, device: str | None = None, seed: int = 0) -> LoadedModel:
        dev = device or self.opt.device
        return self.memo(("tiny", dtype, compiled, dev, seed), lambda: load_model(
            "tiny-llama" if seed == 0 else f"tiny-draft-{seed}", "builtin:tiny-llama", dtype=dtype, device=dev,
            matmul="torch", compile=compiled, tiny={"seed": seed} if seed else None))

    def draft(self, dtype: str, compiled: bool) -> LoadedModel:
        # another random model on the same tokenizer: it disagrees with the target often
        return self.tiny(dtype, compiled, seed=1)

    def prompts(self) -> list[list[int]]:
        texts = ["Explain what a static KV cache is.", "Write a Python function that reverses a list.",
                 "Summarise: the cat sat on the mat and the cat sat on the mat again.", "What is 12 times 7?"]
        tok = self.tiny("fp32", False, "cpu")
        return [tok.chat_ids([{"role": "user", "content": t}]) for t in texts[:self.opt.check_prompts]]

    def reference(self, dtype: str) -> LoadedModel:
        """fp32: the CPU's fp32 model (what the device must reproduce); bf16: the device's eager bf16 model."""
        return self.tiny("fp32", False, "cpu") if dtype == "fp32" else self.tiny("bf16", False)

    def reference_outputs(self, dtype: str) -> list[list[int]]:
        from specdec.strategies.greedy import Greedy

        def build() -> list[list[int]]:
            greedy = Greedy(self.reference(dtype), "greedy", MAX_LEN)
            return [greedy.generate(p, self.check_params(), 0).output_ids for p in self.prompts()]

        return self.memo(("ref", dtype), build)

    def check_params(self) -> GenerationParams:
        return GenerationParams(self.opt.check_tokens, eos_ids=())  # fixed length: no early EOS

    def big(self) -> LoadedModel:
        return self.memo("big", lambda: random_llama(SHAPES[self.opt.shape], self.opt.device, torch.bfloat16
                                                     if self.dev.type == "cuda" else torch.float32))

    def big_draft(self) -> LoadedModel:
        target = self.big()
        return self.memo("big_draft", lambda: random_llama(DRAFT_SHAPES[self.opt.shape], self.opt.device,
                                                           target.dtype, keep_hf=False, seed=1))

    def speed_prompts(self) -> list[list[int]]:
        vocab = SHAPES[self.opt.shape]["vocab_size"]
        return [[(i * 7919 + j) % (vocab - 3) + 3 for i in range(self.opt.context)]
                for j in range(self.opt.speed_prompts)]

    def speed_params(self) -> GenerationParams:
        return GenerationParams(self.opt.new_tokens, eos_ids=())

    def speed_max_len(self) -> int:
        """One cache size for every speed engine: compiled steps are traced per bucket and cache size,
        so the verification cases reuse the graphs the compiled greedy traced."""
        return self.opt.context + max(self.opt.new_tokens, max(self.opt.ks)) + 64


def random_llama(shape: dict[str, Any], device: str, dtype: torch.dtype, keep_hf: bool = True,
                 seed: int = 0) -> LoadedModel:
    """A Llama of the given shape with random weights created on `device` in `dtype` (no host copy),
    as our compact model and, sharing the tensors it does not fuse, as transformers' (the peers)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from specdec.models.llama import Llama, LlamaArgs

    tok = load_model("tiny-llama", "builtin:tiny-llama", device="cpu", matmul="torch")  # ids only, never text
    cfg = AutoConfig.for_model("llama", bos_token_id=0, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
                               **shape)
    torch.manual_seed(seed)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval().requires_grad_(False)
    with torch.device("meta"):
        compact = Llama(LlamaArgs.from_hf(cfg))
    compact.load_hf_state_dict({k: v.detach() for k, v in hf.state_dict().items()})
    compact.eval().requires_grad_(False)
    name = f"llama-{shape['num_hidden_layers']}x{shape['hidden_size']}-random"
    return LoadedModel(name, tok.folder, tok.tokenizer, compact, "compact", dtype, torch.device(device),
                       eos_ids=(), _hf=hf if keep_hf else None)

