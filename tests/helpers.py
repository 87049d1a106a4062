"""Reference recomputations the tests compare the engine against: the slow, obvious way."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file
from torch import Tensor

from specdec.cli_checks import CONFIG_DIR
from specdec.engine.engine import StaticEngine
from specdec.models.loader import LoadedModel, load_model
from specdec.strategies.base import DecodeState, GenerationParams, SpeculativeStrategy, TurnResult
from specdec.verify import Proposal, Verdict


def chain_forward(model: object, ids: list[int], max_len: int = 256) -> tuple[StaticEngine, Tensor]:
    """A fresh engine fed `ids` as one chain from an empty cache: (engine, logits (T, V) of every token)."""
    engine = StaticEngine(model, max_len)
    out = engine.forward(torch.tensor(ids))
    return engine, out.logits


def filled(engine: StaticEngine) -> tuple[Tensor, Tensor]:
    """K/V of the committed slots of sequence 0: (L, H_kv, T, D) each."""
    n = engine.length
    return engine.cache.k[:, 0, :, :n], engine.cache.v[:, 0, :, :n]


def assert_kv_matches_fresh(engine: StaticEngine, ids: list[int], atol: float = 1e-5) -> StaticEngine:
    """The engine's cache holds exactly what recomputing `ids` from scratch would hold."""
    assert engine.length == len(ids)
    fresh, _ = chain_forward(engine.model, ids, engine.max_len)
    k, v = filled(engine)
    k_ref, v_ref = filled(fresh)
    torch.testing.assert_close(k, k_ref, atol=atol, rtol=1e-4)
    torch.testing.assert_close(v, v_ref, atol=atol, rtol=1e-4)
    return fresh


def assert_cache_matches_fresh(engine: StaticEngine, ids: list[int], atol: float = 1e-5) -> None:
    """As assert_kv_matches_fresh, and the next token's logits agree too (the engine is left as it was)."""
    fresh = assert_kv_matches_fresh(engine, ids, atol)
    probe = torch.tensor([7])
    torch.testing.assert_close(engine.forward(probe).logits, fresh.forward(probe).logits, atol=atol, rtol=1e-4)
    engine.rollback(len(ids))


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=gen).tolist()


# --- shared by the prompt-lookup and lookahead tests ---------------------------------------------

REPEATING_TEXT = "The cat sat on the mat. The cat sat on the mat. The cat sat on the mat. The cat sat on the"


def make_looping_target() -> LoadedModel:
    """A tiny random model with small weights: its greedy output settles into long runs of one token,
    so copying from the sequence pays off (a stand-in for the loops and quotes of real models)."""
    cfg = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "model" / "tiny-llama.yaml"), resolve=True)
    assert isinstance(cfg, dict)
    cfg.pop("_target_")
    cfg["tiny"] = {**cfg["tiny"], "initializer_range": 0.1}
    return load_model(**cfg)


def prompts(target: LoadedModel) -> dict[str, list[int]]:
    tok = target.tokenizer
    return {
        "repeating": tok(REPEATING_TEXT)["input_ids"],
        "pattern": [17, 40, 99, 23] * 6,
        "no_repeats": list(range(3, 40)),
        "one_token": [42],
        "chat": target.chat_ids([{"role": "user", "content": "Explain why the sky is blue."}]),
    }


def check_counters(res: TurnResult, max_new: int) -> None:
    """The turn's accounting: accept lengths, decode steps and per-position counts agree."""
    assert sum(res.accept_lengths) == len(res.output_ids) <= max_new
    assert len(res.accept_lengths) == res.decode_steps + 1
    assert 0 <= res.accepted <= res.proposed
    assert sum(res.accepted_by_pos) == res.accepted
    assert sum(res.proposed_by_pos) == res.proposed
    assert all(a <= p for a, p in zip(res.accepted_by_pos, res.proposed_by_pos))
    # every pass commits its accepted drafts plus one token, except where the budget cut it
    assert sum(res.accept_lengths[1:]) <= res.accepted + res.decode_steps
    assert sum(res.accept_lengths[1:]) >= res.decode_steps


def speculative_rounds(strategy: SpeculativeStrategy, prompt: list[int], rounds: int, params: GenerationParams
                       ) -> Iterator[tuple[DecodeState, Proposal, Verdict, Any]]:
    """The greedy decode loop one round at a time, stopping after each commit so a test can inspect the
    caches: yields (state, proposal, verdict, proposer)."""
    out = strategy.engine.prefill(prompt)
    state = DecodeState(list(prompt), len(prompt), params, None)
    state.ids.append(int(out.logits[-1].argmax()))
    proposer = strategy.make_proposer()
    proposer.start(state, out)
    for _ in range(rounds):
        proposal = proposer.propose(state)
        assert proposal is not None
        verdict, out = strategy._step(state, proposal)
        state.ids.extend(verdict.tokens)
        proposer.commit(state, verdict, out)
        yield state, proposal, verdict, proposer


def assert_draws_follow(counts: Tensor, p: Tensor, min_bins: int = 4) -> None:
    """`counts` (V,) of n seeded draws fit the distribution `p` (V,): nothing outside its support, and a
    chi-square test over the tokens expected at least 5 times (the rest lumped into one bin)."""
    from scipy.stats import chisquare

    n = float(counts.sum())
    assert counts[p == 0].sum() == 0  # nothing outside the target's nucleus
    big = p * n >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    expected = torch.cat([p[big], p[~big].sum()[None]]) * n
    keep = expected > 0
    assert big.sum() >= min_bins  # enough distinct outcomes for the test to mean something
    assert chisquare(observed[keep].numpy(), expected[keep].numpy()).pvalue > 1e-3


def tiny_train_overrides(head: str, out: Any, data_dir: Any, max_new_tokens: int = 16) -> list[str]:
    """`python -m heads.train` overrides for a seconds-long run on tiny-llama (callers add steps, lr, head)."""
    return ["model=tiny-llama", f"head={head}", f"output_dir={out}", f"data.cache_dir={data_dir}",
            "data.per_category=1", "data.seeds=[1]", "data.instructions=0", f"data.max_new_tokens={max_new_tokens}",
            "data.batch_size=4",
            "train.batch_size=2", "train.seq_len=96", "train.torch_threads=1", "train.log_every=100",
            "train.val_fraction=0"]


def spy_compactions(strategy: SpeculativeStrategy) -> list[list[int]]:
    """Record every K/V compaction of the strategy's engine as the kept slots relative to its start."""
    compactions: list[list[int]] = []
    real_compact = strategy.engine.compact

    def spy(start: int, keep: list[int]) -> None:
        compactions.append([k - start for k in keep])
        real_compact(start, keep)

    strategy.engine.compact = spy  # type: ignore[method-assign]
    return compactions


def pair_batch(n_seq: int, length: int, tokens: int, seed: int) -> tuple[dict[str, Tensor], Tensor]:
    """A training batch for Medusa heads: sequences of pairs (a, follow[a]) with a random, and hidden
    states that carry nothing. Token t + 2 is fixed by token t + 1 when it is a pair's second token, so
    only heads that read the root can guess head 0's tokens on new data, and only heads that read the
    path's token t + 2 can guess head 1's (t + 3)."""
    follow = torch.randperm(tokens, generator=torch.Generator().manual_seed(0)) + 10  # token a -> follow[a - 10]
    gen = torch.Generator().manual_seed(seed)
    ids = torch.empty(n_seq, length, dtype=torch.long)
    for t in range(length):
        fresh = torch.randint(10, 10 + tokens, (n_seq,), generator=gen)
        ids[:, t] = fresh if t % 2 == 0 else follow[ids[:, t - 1] - 10]
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    hidden = 0.1 * torch.randn(n_seq, length, 64, generator=gen)  # small: noise, not a signal to memorise
    return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}, hidden


def fit_on_pairs(trainable: Any, target: LoadedModel, steps: int = 150) -> tuple[Any, dict[str, float]]:
    """Train `trainable`'s heads on `pair_batch` data; -> the module and its metrics on new pairs."""
    torch.manual_seed(0)
    batch, hidden = pair_batch(32, 32, 8, seed=1)
    module = trainable.build(target)
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        loss, _ = trainable.loss(module, batch, hidden)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():  # new sequences and states, the same rule
        _, metrics = trainable.loss(module, *pair_batch(8, 32, 8, seed=2))
    return module, metrics


def save_random_eagle(target: LoadedModel, folder: Any) -> Any:
    """A randomly initialised EAGLE drafter for `target`, saved the way a trained one is, into folder.
    Random blocks give a near-uniform drafter; its input layer is sharpened so that it drafts confidently."""
    from heads.eagle import EagleTrainable

    trainable = EagleTrainable(kept_vocab=0, save_dtype="fp32")
    module = trainable.build(target, None)
    with torch.no_grad():
        module.net.fc.weight.mul_(8)
    trainable.save(module, folder, {"steps": 0})
    return folder


def saved_eagle(target: LoadedModel, folder: Path, layout: str, layers: int = 2) -> Path:
    """A random drafter of `layout`, its fc sharpened and every applied norm scale perturbed, saved as trained."""
    from heads.eagle import EagleTrainable, EagleTrainModule

    trainable = EagleTrainable(layers=layers, kept_vocab=0, save_dtype="fp32", layout=layout)
    net = trainable.build(target, None).net
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        net.fc.weight.mul_(8)
        for name, p in net.named_parameters():
            if p.requires_grad and p.dim() == 1 and "norm" in name:  # PassThroughNorms' weights are frozen
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
    trainable.save(EagleTrainModule(net), folder, {"steps": 0})
    return folder


# --------------------------------------------------------------------------------------------------
# Published checkpoints written out by hand: the pieces the EAGLE-1 and EAGLE-3 references share
# --------------------------------------------------------------------------------------------------


def rand(*shape: int, seed: int, scale: float = 1.0) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def write_checkpoint(out: Path, state: dict[str, Tensor], config: dict[str, Any], file: str) -> None:
    """A folder as the published trainers leave it: weights (safetensors, or a pickled state dict) + config.json."""
    out.mkdir(parents=True, exist_ok=True)
    if file.endswith(".safetensors"):
        save_file(state, str(out / file))
    else:
        torch.save(state, out / file)
    (out / "config.json").write_text(json.dumps(config))


def eagle3_checkpoint(out: Path, target: LoadedModel, D: int = 64, file: str = "model.safetensors",
                      draft_vocab: int = 200, extra: dict[str, Any] | None = None
                      ) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """An EAGLE-3 drafter as SafeAILab's EAGLE-3 code saves it (cnets.Model's state dict, its config.json);
    a drafter narrower than the target (D != target hidden) brings its own embedding, as such drafters must."""
    V, tD = target.vocab_size, target.hidden_size
    H, KV, FF = 4, 2, 96
    hd = D // H
    kept = torch.randperm(V, generator=torch.Generator().manual_seed(0))[:draft_vocab].sort().values
    s, m = 1 / math.sqrt(D), "midlayer."
    st = {"fc.weight": rand(D, 3 * tD, seed=1, scale=1 / math.sqrt(3 * tD)),
          "norm.weight": 1 + rand(D, seed=2, scale=0.1), "lm_head.weight": rand(draft_vocab, D, seed=3, scale=s),
          m + "hidden_norm.weight": 1 + rand(D, seed=4, scale=0.1),
          m + "input_layernorm.weight": 1 + rand(D, seed=5, scale=0.1),
          m + "post_attention_layernorm.weight": 1 + rand(D, seed=6, scale=0.1),
          m + "self_attn.q_proj.weight": rand(H * hd, 2 * D, seed=7, scale=s),
          m + "self_attn.k_proj.weight": rand(KV * hd, 2 * D, seed=8, scale=s),
          m + "self_attn.v_proj.weight": rand(KV * hd, 2 * D, seed=9, scale=s),
          m + "self_attn.o_proj.weight": rand(D, H * hd, seed=10, scale=s),
          m + "mlp.gate_proj.weight": rand(FF, D, seed=11, scale=s),
          m + "mlp.up_proj.weight": rand(FF, D, seed=12, scale=s),
          m + "mlp.down_proj.weight": rand(D, FF, seed=13, scale=1 / math.sqrt(FF)),
          "d2t": kept - torch.arange(draft_vocab), "t2d": torch.zeros(V, dtype=torch.bool).index_fill(0, kept, True)}
    if D != tD:
        st["embed_tokens.weight"] = rand(V, D, seed=14, scale=0.5)
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu", "hidden_size": D,
           "intermediate_size": FF, "num_attention_heads": H, "num_key_value_heads": KV, "num_hidden_layers": 1,
           "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 50000.0, "rope_scaling": None,
           "vocab_size": V, "draft_vocab_size": draft_vocab, "tie_word_embeddings": False, "torch_dtype": "float16",
           "bos_token_id": 0, "eos_token_id": 2, "pretraining_tp": 1, "use_cache": True}
    if D != tD:
        cfg["target_hidden_size"] = tD
    cfg |= extra or {}
    write_checkpoint(out, st, cfg, file)
    return cfg, st


def rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def reference_attention(x: Tensor, st: dict[str, Tensor], prefix: str, heads: int, kv_heads: int,
                        theta: float) -> Tensor:
    """Llama self-attention over one sequence from position 0, causal, no cache: x (T, E) -> (T, H*hd),
    before o_proj. Weights are read from `st` under `prefix` (q/k/v_proj)."""
    T = x.shape[0]
    hd = st[prefix + "q_proj.weight"].shape[0] // heads
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = (torch.arange(T, dtype=torch.float64)[:, None] * inv[None]).float()
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]  # (T, 1, hd)

    def rope(t: Tensor) -> Tensor:
        a, b = t.chunk(2, dim=-1)
        return t * cos + torch.cat([-b, a], -1) * sin

    q = rope((x @ st[prefix + "q_proj.weight"].t()).view(T, heads, hd))  # (T, H, hd)
    k = rope((x @ st[prefix + "k_proj.weight"].t()).view(T, kv_heads, hd))  # (T, KV, hd)
    v = (x @ st[prefix + "v_proj.weight"].t()).view(T, kv_heads, hd)
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    att = torch.einsum("thd,shd->hts", q, k) / math.sqrt(hd)
    att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    return torch.einsum("hts,shd->thd", att, v).reshape(T, heads * hd)
