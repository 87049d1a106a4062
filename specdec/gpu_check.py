"""`python -m specdec.gpu_check [--out DIR]`: the one-script GPU check; nothing is downloaded.

1. Correctness on a tiny random model (built from a config): greedy on the GPU against greedy on the
   CPU (fp32, token agreement); draft-model decoding, Medusa token trees and prompt lookup on the GPU
   against the GPU's own greedy (lossless: identical tokens); and one token-tree pass on the GPU
   against sequential decoding of every node's path.
2. Speed on random weights in a Llama-7B shape (bf16): ms per token of our greedy against
   transformers `generate()` on the same weights, interleaved; bytes of weights read per second
   against the device's measured bandwidth; the verification-cost curve k = 1 ... 64.

Writes gpu_check.json and gpu_check.md into --out. Meant to finish within about 8 minutes on one
H200; `--device cpu --shape tiny` runs the same code path on a CPU in seconds (the tests do).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from specdec.engine.engine import StaticEngine
from specdec.models.loader import LoadedModel, load_model
from specdec.strategies.base import GenerationParams, Strategy

# Llama-2-7B's shape; "tiny" keeps the speed section runnable on a CPU for the tests
SHAPES: dict[str, dict[str, int]] = {
    "7b": {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 32, "vocab_size": 32000},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 512},
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _tiny(device: str) -> LoadedModel:
    return load_model("tiny-llama", "builtin:tiny-llama", device=device, matmul="torch")


def _prompts(target: LoadedModel, n: int) -> list[list[int]]:
    texts = ["Explain what a static KV cache is.", "Write a Python function that reverses a list.",
             "Summarise: the cat sat on the mat and the cat sat on the mat again.", "What is 12 times 7?"]
    return [target.chat_ids([{"role": "user", "content": t}]) for t in texts[:n]]


def correctness(device: str, new_tokens: int = 32) -> dict[str, Any]:
    """Token agreement of the GPU's strategies with its own greedy, and of the GPU's greedy with the CPU's."""
    from heads.eagle import EagleTrainable
    from heads.medusa import medusa_heads
    from specdec.strategies.draft import DraftStrategy, FixedLength
    from specdec.strategies.eagle import EagleStrategy
    from specdec.strategies.greedy import Greedy
    from specdec.strategies.hybrid import LookupHybrid
    from specdec.strategies.medusa import Medusa
    from specdec.strategies.prompt_lookup import PromptLookup

    cpu, gpu = _tiny("cpu"), _tiny(device)
    draft = load_model("tiny-draft", "builtin:tiny-llama", device=device, matmul="torch",
                       tiny={"seed": 1})  # another random model on the same tokenizer: rejects often
    params = GenerationParams(new_tokens, eos_ids=())
    prompts = _prompts(gpu, 4)
    ref_cpu = [Greedy(cpu, "greedy", 512).generate(p, params, 0).output_ids for p in prompts]
    ref_gpu = [Greedy(gpu, "greedy", 512).generate(p, params, 0).output_ids for p in prompts]
    strategies: dict[str, Strategy] = {
        "draft_random": DraftStrategy(gpu, "draft", draft, FixedLength(4), 512),
        "draft_self": DraftStrategy(gpu, "draft", gpu, FixedLength(4), 512),  # the target drafts: all accepted
        "medusa_tree": Medusa(gpu, max_len=512, heads=medusa_heads(gpu, num_heads=3, seed=0), tree="default"),
        "prompt_lookup": PromptLookup(gpu, max_len=512),
        # an untrained EAGLE-style drafter on the GPU target's own hidden states: the pair bookkeeping on CUDA
        "eagle_random": EagleStrategy(gpu, "eagle", EagleTrainable(kept_vocab=0).build(gpu, None).net.eval(),
                                      FixedLength(3), 512),
        # prompt lookup in front of the random draft: both sources, and the draft catching up, on CUDA
        "draft_lookup_random": LookupHybrid(gpu, "draft_lookup", partial(DraftStrategy, name="draft", draft=draft,
                                                                          schedule=FixedLength(4)), 512),
    }
    out: dict[str, Any] = {"greedy_gpu_vs_cpu": _agreement(ref_gpu, ref_cpu)}
    for name, s in strategies.items():
        got = [s.generate(p, params, 0).output_ids for p in prompts]
        out[name] = _agreement(got, ref_gpu)
    out["tree_logits_max_abs_diff"] = _tree_vs_paths(gpu, prompts[0])
    out["passed"] = all(out[k] == 1.0 for k in strategies) and out["tree_logits_max_abs_diff"] < 1e-3
    return out


def _agreement(got: list[list[int]], want: list[list[int]]) -> float:
    return sum(a == b for a, b in zip(got, want)) / len(want)


def _tree_vs_paths(target: LoadedModel, prompt: list[int]) -> float:
    """Largest logit difference between one tree pass and sequential decoding of each node's path."""
    from specdec.trees import paths_to_parents, tree_depth, tree_mask

    paths = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    parents, _ = paths_to_parents(paths)  # node i >= 1 hangs below parents[i - 1]; 0 is the root
    tokens = torch.tensor([5 + 3 * i for i in range(len(parents) + 1)])  # root + nodes
    engine = StaticEngine(target.model, 512)
    engine.prefill(prompt)
    n = engine.length
    tree = engine.forward(tokens, tree_depth(parents), tree_mask(parents)).logits  # (N + 1, V)
    worst = 0.0
    for i in range(len(tokens)):
        chain, j = [int(tokens[i])], i
        while j > 0:
            j = parents[j - 1]
            chain.append(int(tokens[j]))
        engine.rollback(n)
        seq = engine.forward(torch.tensor(chain[::-1])).logits[-1]
        worst = max(worst, float((seq - tree[i]).abs().max()))
    return worst


def random_llama(shape: str, device: str, dtype: torch.dtype) -> LoadedModel:
    """A Llama of the given shape with random weights, as our compact model and as transformers'."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from specdec.models.llama import Llama, LlamaArgs

    tok = _tiny("cpu")  # a tokenizer for the peers' padding; the random model never decodes text
    cfg = AutoConfig.for_model("llama", max_position_embeddings=4096, rope_theta=10000.0, bos_token_id=0,
                               eos_token_id=2, pad_token_id=0, **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    with torch.device("meta"):
        compact = Llama(LlamaArgs.from_hf(cfg))
    compact.load_hf_state_dict({k: v.detach() for k, v in hf.state_dict().items()})
    compact.eval().requires_grad_(False)
    return LoadedModel(f"llama-{shape}-random", tok.folder, tok.tokenizer, compact, "compact", dtype,
                       torch.device(device), eos_ids=(), _hf=hf)


def device_bandwidth_gbs(device: torch.device, mbytes: int = 1024, reps: int = 5) -> float:
    """Read bandwidth of a reduction over a large buffer (CPU) or a device-to-device copy (GPU)."""
    n = mbytes * 2**20 // 4
    src = torch.ones(n, device=device)
    dst = torch.empty_like(src) if device.type == "cuda" else None
    best = float("inf")
    for _ in range(reps + 1):
        _sync(device)
        t0 = time.perf_counter()
        if dst is not None:
            dst.copy_(src)
        else:
            src.sum()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    moved = n * 4 * (2 if dst is not None else 1)  # a copy reads and writes every byte
    return moved / best / 1e9


def speed(shape: str, device: str, dtype: torch.dtype, new_tokens: int, rounds: int,
          ks: list[int], context: int) -> dict[str, Any]:
    from specdec.bench import compare_greedy, weight_bytes
    from specdec.strategies.greedy import Greedy
    from specdec.strategies.hf import HFGenerate

    target = random_llama(shape, device, dtype)
    dev = torch.device(device)
    strategies: dict[str, Strategy] = {"greedy": Greedy(target, "greedy", 2048),
                                       "hf_generate": HFGenerate(target, "hf_generate", 2048)}
    vocab = SHAPES[shape]["vocab_size"]
    prompts = [[(i * 7919 + j) % (vocab - 3) + 3 for i in range(context)] for j in range(2)]
    params = GenerationParams(new_tokens, eos_ids=())
    compare_greedy(strategies, target, prompts[:1], GenerationParams(8, eos_ids=()), 1)  # warm-up
    timings = compare_greedy(strategies, target, prompts, params, rounds)
    bandwidth = device_bandwidth_gbs(dev)
    nbytes = weight_bytes(target.model)
    for t in timings.values():
        t["fraction_of_bandwidth"] = nbytes / (t["ms_per_token"] / 1e3) / 1e9 / bandwidth
    return {"shape": shape, "dtype": str(dtype).removeprefix("torch."), "weight_bytes": nbytes,
            "bandwidth_gb_per_s": bandwidth, "bandwidth_bound_ms_per_token": nbytes / bandwidth / 1e6,
            "greedy_vs_hf": timings,
            "speedup_greedy_over_hf": timings["greedy"]["tokens_per_s"] / timings["hf_generate"]["tokens_per_s"],
            "verification_ratio": verification_ratio(target, ks, context)}


def verification_ratio(target: LoadedModel, ks: list[int], context: int, reps: int = 5) -> dict[int, float]:
    """Time of one pass over k new tokens after `context` cached ones, relative to k = 1 (synchronised)."""
    engine = StaticEngine(target.model, context + max(ks) + 1)
    engine.prefill([3 + i % 100 for i in range(context)])
    ms: dict[int, float] = {}
    for k in [1, *ks]:  # k = 1 twice: the first pass warms up
        tokens = torch.arange(k) + 3
        samples = []
        for _ in range(reps):
            _sync(engine.device)
            t0 = time.perf_counter()
            engine.forward(tokens)
            _sync(engine.device)
            samples.append(time.perf_counter() - t0)
            engine.rollback(context)
        ms[k] = statistics.median(samples) * 1e3
    return {k: ms[k] / ms[1] for k in ks}


def to_markdown(r: dict[str, Any]) -> str:
    c, s = r["correctness"], r["speed"]
    lines = [f"# specdec.gpu_check on {r['device_name']}", "", f"Command: `{r['command']}` ({r['date']})", "",
             "## Correctness (tiny random model; 1.0 = every output identical)", "",
             "| check | result |", "|---|---|", *(f"| {k} | {v} |" for k, v in c.items()), "",
             f"## Speed: random weights, Llama {s['shape']} shape, {s['dtype']}", "",
             f"- weights {s['weight_bytes'] / 1e9:.2f} GB; measured bandwidth {s['bandwidth_gb_per_s']:.0f} GB/s; "
             f"bound {s['bandwidth_bound_ms_per_token']:.2f} ms/token",
             f"- greedy / hf_generate: {s['speedup_greedy_over_hf']:.2f}x", "",
             "| decoder | tokens/s | ms/token | fraction of bandwidth |", "|---|---|---|---|",
             *(f"| {k} | {v['tokens_per_s']:.1f} | {v['ms_per_token']:.2f} | {v['fraction_of_bandwidth']:.2f} |"
               for k, v in s["greedy_vs_hf"].items()), "",
             "| k new tokens | pass time / k = 1 |", "|---|---|",
             *(f"| {k} | {v:.2f} |" for k, v in s["verification_ratio"].items()), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", default="7b", choices=sorted(SHAPES))
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--ks", default="1,2,4,8,16,32,64")
    p.add_argument("--out", default="experiments/gpu")
    a = p.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: no CUDA device visible; run on a GPU machine or pass --device cpu --shape tiny", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    started = time.perf_counter()
    result: dict[str, Any] = {
        "command": " ".join(["python -m specdec.gpu_check", *(argv if argv is not None else sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name() if a.device.startswith("cuda") else "CPU",
        "correctness": correctness(a.device),
    }
    result["speed"] = speed(a.shape, a.device, dtype, a.new_tokens, a.rounds, [int(k) for k in a.ks.split(",")],
                            a.context)
    result["seconds"] = time.perf_counter() - started
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2, default=str))
    (out / "gpu_check.md").write_text(to_markdown(result))
    print(to_markdown(result))
    return 0 if result["correctness"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
