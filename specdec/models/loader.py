"""Resolve a model config to a local folder and load it: our compact model or a transformers model."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdec.errors import SpecdecError
from specdec.models.cpu_linear import use_numpy_linears
from specdec.models.gguf import cached_gguf_folder
from specdec.models.llama import SUPPORTED_TYPES, Llama, LlamaArgs
from specdec.models.smollm2 import smollm2_folder
from specdec.models.tiny import tiny_folder

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
UNSAFE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SpecdecError(f"device={device} requested but no CUDA GPU is visible; use model.device=cpu")
    return torch.device(device)


def resolve_dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise SpecdecError(f"unknown dtype {dtype!r}; use one of fp32, bf16, fp16")
    return DTYPES[dtype]


def resolve_folder(path: str, tiny: dict[str, Any] | None = None, revision: str | None = None) -> Path:
    """builtin:NAME, a .gguf file, a local Hugging Face folder or a hub id -> a folder of safetensors."""
    if path == "builtin:smollm2-135m":
        return smollm2_folder()
    if path == "builtin:tiny-llama":
        return tiny_folder(**(tiny or {}))
    local = Path(path).expanduser()
    if path.endswith(".gguf"):
        return cached_gguf_folder(local)
    if local.is_dir():
        if not list(local.glob("*.safetensors")):
            unsafe = [p.name for p in local.iterdir() if p.suffix in UNSAFE_SUFFIXES]
            hint = f" (found {unsafe[0]}: pickled weights are refused)" if unsafe else ""
            raise SpecdecError(f"no .safetensors weights in {local}{hint}; convert the model to safetensors or GGUF")
        return local
    if local.exists() or path.startswith((".", "/", "~")):
        suffix = f" ({local.suffix} files are pickles and are refused)" if local.suffix in UNSAFE_SUFFIXES else ""
        raise SpecdecError(f"model path {path} is not a model folder or .gguf file{suffix}; "
                           "pass a Hugging Face folder with safetensors, a GGUF file or a hub id")
    return _from_hub(path, revision)


def _from_hub(repo: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(repo, revision=revision, allow_patterns=[
            "*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]))
    except Exception as e:  # offline, unknown repo, gated repo: all end the same way for the user
        raise SpecdecError(f"cannot fetch model {repo!r} from the hub ({type(e).__name__}); check the name "
                           "and the network, or pass a local folder or GGUF file as model.path") from e
    if not list(folder.glob("*.safetensors")):
        raise SpecdecError(f"hub model {repo} has no safetensors weights; pickled weights are refused")
    return folder


def _load_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        try:
            state.update(load_file(str(shard)))
        except Exception as e:
            raise SpecdecError(f"cannot read {shard}: {e} (truncated or corrupt; delete it and rebuild "
                               "the cache)") from e
    return state


@dataclass
class LoadedModel:
    """The target (or draft) as every strategy sees it: one tokenizer, one set of weights."""

    name: str
    folder: Path
    tokenizer: Any
    model: Any  # specdec.models.llama.Llama, or a transformers model for other architectures
    backend: str  # "compact" or "hf"
    dtype: torch.dtype
    device: torch.device
    trust_remote_code: bool = False
    eos_ids: tuple[int, ...] = ()
    torch_threads: int | None = None  # torch's thread count while our model runs (None: leave it)
    _hf: Any = field(default=None, repr=False)

    @property
    def vocab_size(self) -> int:
        return int(self.model.args.vocab_size if self.backend == "compact" else self.model.config.vocab_size)

    def hf_model(self) -> Any:
        """The same weights as a transformers model, for the transformers peer strategies."""
        if self.backend == "hf":
            return self.model
        if self._hf is None:
            from transformers import AutoModelForCausalLM

            self._hf = AutoModelForCausalLM.from_pretrained(
                self.folder, dtype=self.dtype, use_safetensors=True,
                trust_remote_code=self.trust_remote_code).to(self.device).eval()
        return self._hf

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation through the model's chat template, ready for the reply."""
        if getattr(self.tokenizer, "chat_template", None):
            out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False)
            return list(out)
        text = "\n\n".join(m["content"] for m in messages)  # base models: plain concatenation
        return self.tokenizer(text)["input_ids"]


def load_model(name: str, path: str, backend: str = "compact", dtype: str = "fp32", device: str = "cpu",
               trust_remote_code: bool = False, revision: str | None = None,
               tiny: dict[str, Any] | None = None, matmul: str = "auto") -> LoadedModel:
    """Entry point for `configs/model/*.yaml` (`_target_: specdec.models.load_model`)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    dev, dt = resolve_device(device), resolve_dtype(dtype)
    folder = resolve_folder(path, tiny, revision)
    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    if backend not in ("compact", "hf"):
        raise SpecdecError(f"unknown model.backend {backend!r}; use compact or hf")
    if backend == "compact" and config.model_type not in SUPPORTED_TYPES:
        backend = "hf"  # other architectures run through transformers, chain strategies only
    threads = None
    if backend == "compact":
        with torch.device("meta"):
            model = Llama(LlamaArgs.from_hf(config))
        state = {k: v.to(dtype=dt, device=dev) for k, v in _load_safetensors(folder).items()}
        model.load_hf_state_dict(state)
        model.eval().requires_grad_(False)
        if matmul not in ("auto", "torch", "numpy"):
            raise SpecdecError(f"unknown model.matmul {matmul!r}; use auto, torch or numpy")
        if matmul == "numpy" or (matmul == "auto" and dev.type == "cpu" and dt == torch.float32):
            use_numpy_linears(model)
            threads = 1
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dt, use_safetensors=True,
                                                     trust_remote_code=trust_remote_code).to(dev).eval()
    eos: list[int] = []
    try:
        gen_eos = GenerationConfig.from_pretrained(folder).eos_token_id
        eos += gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []
    except OSError:
        pass
    if tokenizer.eos_token_id is not None:
        eos.append(tokenizer.eos_token_id)
    return LoadedModel(name, folder, tokenizer, model, backend, dt, dev, trust_remote_code,
                       tuple(dict.fromkeys(eos)), threads)

