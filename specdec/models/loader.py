"""Resolve a model config to a local folder and load it: our compact model or a transformers model."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specdec.errors import SpecdecError
from specdec.models import cpu_kernels
from specdec.models.cpu_linear import MATMULS, pick_faster_linears, use_matmul
from specdec.models.gguf import cached_gguf_folder
from specdec.models.llama import SUPPORTED_TYPES, Llama, LlamaArgs
from specdec.models.smollm2 import smollm2_folder
from specdec.models.tiny import tiny_folder

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
UNSAFE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def _one_line(text: object) -> str:
    # Library messages span lines; the CLI prints one line per error.
    return " ".join(str(text).split())


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SpecdecError(f"device={device} requested but no CUDA GPU is visible; use model.device=cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device | None = None) -> torch.dtype:
    """`auto`: bf16 on CUDA (what GPUs decode in), fp32 elsewhere (the CPU kernels run fp32)."""
    if dtype == "auto":
        return torch.bfloat16 if device is not None and device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise SpecdecError(f"unknown dtype {dtype!r}; use auto or one of fp32, bf16, fp16")
    return DTYPES[dtype]


def resolve_compile(compile: bool | str, device: torch.device) -> bool:
    """`auto`: compile on CUDA (CUDA graphs per token bucket); eager on the CPU, where the numba kernels run."""
    if compile == "auto":
        return device.type == "cuda"
    if not isinstance(compile, bool):
        raise SpecdecError(f"unknown model.compile {compile!r}; use auto, true or false")
    return compile


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


class Checkpoint(Mapping[str, Tensor]):
    """A folder's safetensors tensors by name, each read from its shard when asked for and placed on
    `device` in `dtype` at once; nothing is kept here. So a load holds the model's tensors plus the few
    being fused, and a GPU load holds about one tensor in host memory, never the whole checkpoint."""

    def __init__(self, folder: Path, dtype: torch.dtype, device: torch.device) -> None:
        self.folder, self.dtype, self.device = folder, dtype, device
        self.shards: dict[str, Path] = {}
        for shard in sorted(folder.glob("*.safetensors")):
            with self._open(shard) as f:
                self.shards.update(dict.fromkeys(f.keys(), shard))

    def _open(self, shard: Path) -> Any:
        from safetensors import safe_open

        # CUDA tensors come straight from the file; other devices (and ones safetensors does not know)
        # through the host, a tensor at a time.
        where = str(self.device) if self.device.type == "cuda" else "cpu"
        try:
            return safe_open(str(shard), framework="pt", device=where)
        except Exception as e:
            raise self._damaged(shard, e) from e

    def _damaged(self, shard: Path, e: Exception) -> SpecdecError:
        return SpecdecError(f"cannot read {shard}: {_one_line(e)[:160]} (truncated or corrupt; delete "
                            f"{self.folder} and run again to rebuild or re-fetch it)")

    def __getitem__(self, name: str) -> Tensor:
        shard = self.shards[name]
        # One open per tensor: safetensors maps the whole shard while it is open, and every page read
        # through that mapping stays resident until it closes.
        with self._open(shard) as f:
            try:
                t = f.get_tensor(name)
            except Exception as e:
                raise self._damaged(shard, e) from e
        if t.device != self.device:
            t = t.to(self.device)
        if t.dtype != self.dtype:
            return t.to(self.dtype)  # on the device: a GPU target's host never holds more than this tensor
        return t.clone() if t.device.type == "cpu" else t  # CPU: our own memory, not the shard's mapping

    def __contains__(self, name: object) -> bool:
        return name in self.shards

    def __iter__(self) -> Iterator[str]:
        return iter(self.shards)

    def __len__(self) -> int:
        return len(self.shards)


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
    matmul: str = "torch"  # what runs the linear layers: torch, numpy (BLAS) or numba (specdec's kernels)
    compile: bool = False  # target passes run as torch.compile'd static-shape steps (engine/static_step.py)
    _hf: Any = field(default=None, repr=False)

    @property
    def vocab_size(self) -> int:
        """Width of the logits (may exceed the tokenizer's length: padded embeddings)."""
        return int(self.model.args.vocab_size if self.backend == "compact" else self.model.config.vocab_size)

    @property
    def hidden_size(self) -> int:
        return int(self.model.args.dim if self.backend == "compact" else self.model.config.hidden_size)

    @property
    def context_len(self) -> int:
        """Positions the model was trained for: prompt plus output must stay within them."""
        if self.backend == "compact":
            return int(self.model.args.max_position)
        return int(getattr(self.model.config, "max_position_embeddings", None) or 1 << 30)

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


def load_model(name: str, path: str, backend: str = "compact", dtype: str = "auto", device: str = "cpu",
               trust_remote_code: bool = False, revision: str | None = None,
               tiny: dict[str, Any] | None = None, matmul: str = "auto",
               compile: bool | str = "auto") -> LoadedModel:
    """Entry point for `configs/model/*.yaml` (`_target_: specdec.models.load_model`)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    dev = resolve_device(device)
    dt, compiled = resolve_dtype(dtype, dev), resolve_compile(compile, dev)
    folder = resolve_folder(path, tiny, revision)
    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except ValueError as e:
        if "trust_remote_code" in str(e) and not trust_remote_code:
            raise SpecdecError(f"model {name} ({folder}) needs code from its repository; review it, then set "
                               "model.trust_remote_code=true to run it") from e
        raise SpecdecError(f"cannot read the config or tokenizer in {folder}: {_one_line(e)[:160]}") from e
    except OSError as e:
        raise SpecdecError(f"cannot read the config or tokenizer in {folder}: {_one_line(e)[:160]} "
                           "(incomplete folder? delete it and fetch or rebuild it)") from e
    if backend not in ("compact", "hf"):
        raise SpecdecError(f"unknown model.backend {backend!r}; use compact or hf")
    if backend == "compact" and config.model_type not in SUPPORTED_TYPES:
        backend = "hf"  # other architectures run through transformers, chain strategies only
    threads, kind = None, "torch"
    if backend == "compact":
        with torch.device("meta"):
            model = Llama(LlamaArgs.from_hf(config))
        model.load_hf_state_dict(Checkpoint(folder, dt, dev))  # type: ignore[arg-type]  # read as it fuses them
        model.eval().requires_grad_(False)
        if matmul not in ("auto", *MATMULS):
            raise SpecdecError(f"unknown model.matmul {matmul!r}; use auto, {', '.join(MATMULS)}")
        cpu32 = dev.type == "cpu" and dt == torch.float32
        if matmul in ("numpy", "numba") and not cpu32:
            raise SpecdecError(f"model.matmul={matmul} runs fp32 on the CPU only; use model.matmul=torch "
                               f"for {dtype} on {dev.type}")
        if matmul == "numba" and not cpu_kernels.available():
            raise SpecdecError("model.matmul=numba needs the numba package: pip install numba "
                               "(or use model.matmul=auto)")
        if matmul == "auto":
            kind = pick_faster_linears(model) if cpu32 else "torch"
        else:
            kind = matmul
            use_matmul(model, kind)
        threads = 1 if kind != "torch" else None
        if dev.type == "cpu":
            cpu_kernels.release_freed_memory()
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
                       tuple(dict.fromkeys(eos)), threads, kind, compiled and backend == "compact")



# How many token ids check_same_tokenizer compares, spread evenly over the vocabulary.
TOKEN_SAMPLE = 512


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    """Raise unless draft and target tokenize text identically: same vocabulary size, the same
    token <-> id mapping on an even sample of ids, and the same special tokens.

    A draft with another tokenizer proposes ids that mean different text to the target; decoding
    still "works" but accepts almost nothing and, under sampling, draws from the wrong distribution.
    The logit widths may differ (padded embeddings); strategies compare only the shared ids.
    """
    t, d = target.tokenizer, draft.tokenizer
    fix = "pick a draft from the target's model family (the same tokenizer)"
    if len(t) != len(d):
        raise SpecdecError(f"draft {draft.name} has a vocabulary of {len(d)} tokens but target {target.name} has "
                           f"{len(t)}; {fix}")
    step = max(1, len(t) // TOKEN_SAMPLE)
    ids = list(range(0, len(t), step))[:TOKEN_SAMPLE] + [len(t) - 1]
    t_tokens, d_tokens = t.convert_ids_to_tokens(ids), d.convert_ids_to_tokens(ids)
    for i, a, b in zip(ids, t_tokens, d_tokens):
        if a != b:
            raise SpecdecError(f"draft {draft.name} and target {target.name} have different tokenizers (id {i} is "
                               f"{b!r} for the draft, {a!r} for the target); {fix}")
    for a, b in zip(t_tokens, d_tokens):
        if a is not None and t.convert_tokens_to_ids(a) != d.convert_tokens_to_ids(b):
            raise SpecdecError(f"draft {draft.name} and target {target.name} map token {a!r} to different ids; {fix}")
    t_special = {k: t.convert_tokens_to_ids(v) for k, v in _special_tokens(t).items()}
    d_special = {k: d.convert_tokens_to_ids(v) for k, v in _special_tokens(d).items()}
    for key in sorted(set(t_special) | set(d_special)):
        if t_special.get(key) != d_special.get(key):
            raise SpecdecError(f"draft {draft.name} and target {target.name} differ in special token {key} "
                               f"({d_special.get(key)} vs {t_special.get(key)}); {fix}")


def _special_tokens(tokenizer: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in tokenizer.special_tokens_map.items():
        values = value if isinstance(value, list) else [value]
        for j, v in enumerate(values):
            out[f"{key}[{j}]" if isinstance(value, list) else key] = str(v)
    return out


# Keys under which saved head/drafter configs name the model they were trained on.
BASE_MODEL_KEYS = ("base_model", "base_model_name_or_path", "target")


def check_trained_for(meta: dict[str, Any], target: LoadedModel, what: str = "heads") -> None:
    """Raise unless `meta` (a trained head's or drafter's saved JSON config) was made for `target`.

    Compares whichever of the base model name, hidden size and vocabulary size `meta` records.
    Hidden and vocabulary sizes must match exactly; the name may be the model alias
    (`smollm2-135m`), a hub id or a folder whose last part names the target.
    """
    fix = f"train {what} for {target.name}, or run them with the model they were trained for"
    hidden = meta.get("hidden_size")
    if hidden is not None and int(hidden) != target.hidden_size:
        raise SpecdecError(f"{what} were trained for hidden size {hidden} but {target.name} has {target.hidden_size}; "
                           f"{fix}")
    vocab = meta.get("vocab_size")
    if vocab is not None and int(vocab) != target.vocab_size:
        raise SpecdecError(f"{what} were trained for a vocabulary of {vocab} but {target.name} has "
                           f"{target.vocab_size}; {fix}")
    base = next((str(meta[k]) for k in BASE_MODEL_KEYS if meta.get(k)), None)
    if base is not None and not _names_model(base, target):
        raise SpecdecError(f"{what} were trained for {base} but the target is {target.name} ({target.folder}); "
                           f"{fix}")


def _names_model(base: str, target: LoadedModel) -> bool:
    def norm(x: str) -> str:
        return x.rstrip("/").lower()

    names = {norm(target.name), norm(str(target.folder)), norm(target.folder.name)}
    source = getattr(target.model, "config", None)
    if source is not None and getattr(source, "_name_or_path", ""):
        names.add(norm(source._name_or_path))
    b = norm(base)
    last = b.rsplit("/", 1)[-1]
    # cache folders append a content hash to the model's name: SmolLM2-135M-Instruct-b179c9523d0e
    if b in names or last in {n.rsplit("/", 1)[-1] for n in names}:
        return True
    return norm(target.folder.name).startswith(last + "-")
