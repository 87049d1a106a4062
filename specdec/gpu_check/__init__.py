"""`python -m specdec.gpu_check [--device cuda|cpu] [--shape 8b|tiny] [--out DIR]`: the one-script GPU check.

Nothing is downloaded. Every check is a case of its own: a case that raises is recorded with its error
(type, message, where) and the rest still run; gpu_check.json and gpu_check.md in --out are rewritten
as each case ends, so a run cut short still leaves everything done so far. A time budget (--budget-s)
and a per-case limit (--case-timeout-s) keep the whole run within about 8 minutes on one H200: cases
left when the budget is spent are recorded as skipped.

Correctness, on the tiny random model (`builtin:tiny-llama`), eager and compiled (`load_model(compile=True)`):
- every strategy (greedy, draft models, Medusa trees with plain and sequential heads, EAGLE, prompt
  lookup, lookahead, the lookup hybrids) on the device: in fp32 against greedy on the CPU, in bf16
  against the device's own eager bf16 greedy (bf16 rounds differently from fp32). Identical outputs
  pass; an output that differs passes only if each of its tokens is the reference model's argmax, up
  to a tie tolerance, given the output's own prefix (a pass over k tokens may round differently from
  a one-token step, and flips a near-tie);
- one token-tree pass against sequential decoding of every node's path (fp32 and bf16);
- sampling on the device: chi-square tests that plain sampling, speculative sampling and
  deterministic-draft sampling (specdec.verify) draw from the target's distribution on a small
  vocabulary, and sampled turns of the strategies that are reproducible from their seed.
Speed, on random bf16 weights in Llama-3-8B's shape (built on the device, no host copy):
- ms per token of our greedy (eager, compiled), transformers `generate()` eager and with a static cache
  plus torch.compile, each as a fraction of the measured bandwidth (weight bytes per token / the bytes
  per second of a device-to-device copy);
- the verification-cost curve (one pass over k = 1 ... 64 new tokens) eager and compiled;
- one drafting step of each strategy against one target step.

Order: eager correctness, eager speed, then what compiles (slow to start, the least certain): bf16
correctness, compiled decoding and transformers' static peer, the compiled verification curve (a case
per pass size, each tracing one more token bucket), fp32 correctness. `--cases 'speed/*'` (fnmatch
patterns) reruns a part, `--skip` leaves cases out. `--device cpu --shape tiny` runs the same code on a
CPU (the tests do); compiled cases there use inductor, so only a few strategies run compiled unless
--compiled-strategies says otherwise. Details and how to read the output: docs/gpu_check.md.
"""

from specdec.gpu_check.runner import main

__all__ = ["main"]  # the parts live in models, correctness, speed, report and runner
