"""gpu_check.md: the GPU check's result file as tables (correctness per strategy, tree and sampling,
speed, then what failed or was skipped)."""

from __future__ import annotations

from typing import Any

from specdec.gpu_check.correctness import BATCH, TIE
from specdec.gpu_check.speed import DECODERS


def _cell(entry: dict[str, Any] | None) -> str:
    if entry is None:
        return ""
    r = entry.get("result") or {}
    if entry["status"] in ("error", "skipped"):
        return entry["status"]
    mark = "ok" if entry["status"] == "passed" else "FAIL"
    if "identical" in r:
        return f"{mark} {r['identical']:.2f} ({r['max_deficit']:.2g})"
    return mark


def to_markdown(r: dict[str, Any]) -> str:
    cases: dict[str, dict[str, Any]] = r.get("cases", {})
    s = r.get("summary", {})
    lines = [f"# specdec.gpu_check on {r.get('device_name', '?')}", "",
             f"`{r.get('command', '')}` ({r.get('date', '')}; torch {r.get('torch', '?')}, transformers "
             f"{r.get('transformers', '?')}; fp32 matmul precision {r.get('float32_matmul_precision', '?')})", "",
             f"**{s.get('passed', 0)} passed, {s.get('failed', 0)} failed, {s.get('error', 0)} errors, "
             f"{s.get('skipped', 0)} skipped** in {r.get('seconds', 0.0):.0f} s"
             + ("" if r.get("finished") else " (run not finished)"), ""]
    strategies = list(dict.fromkeys(k.split("/")[3] for k in cases if k.startswith("correct/")))
    if strategies:
        cols = [("fp32", "eager"), ("fp32", "compiled"), ("bf16", "eager"), ("bf16", "compiled")]
        lines += ["## Correctness on the tiny model", "",
                  "Each cell: share of outputs identical to the reference (fp32: CPU greedy; bf16: the device's "
                  "eager bf16 greedy) and, in brackets, the largest logit deficit of an output token below the "
                  f"reference's argmax (ties up to {TIE['fp32']:g} in fp32, {TIE['bf16']:g} in bf16 pass).", "",
                  f"The batched column: {BATCH} slots decoding the prompts together (eager), against CPU fp32 greedy.",
                  "", "| strategy | " + " | ".join(f"{d} {m}" for d, m in cols) + " | fp32 batched |",
                  "|---" * (len(cols) + 2) + "|"]
        for name in strategies:
            cells = [_cell(cases.get(f"correct/{d}/{m}/{name}")) for d, m in cols]
            cells.append(_cell(cases.get(f"batch/fp32/{name}")))
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    other = {k: v for k, v in cases.items() if not k.startswith(("correct/", "speed/", "batch/"))}
    if other:
        lines += ["## Tree pass and sampling", "", "| case | status | figures |", "|---|---|---|"]
        for k, v in other.items():
            figures = {a: b for a, b in (v.get("result") or {}).items() if a != "passed"}
            lines.append(f"| {k} | {v['status']} | {_short(figures) if figures else v.get('error', '')} |")
        lines.append("")
    lines += _speed_markdown(cases)
    problems = {k: v for k, v in cases.items() if v["status"] in ("error", "skipped")}
    if problems:
        lines += ["## Errors and skipped cases", ""]
        lines += [f"- `{k}`: {v.get('error', '')}" + (f" (at {'; '.join(v['where'])})" if v.get("where") else "")
                  for k, v in problems.items()]
        lines.append("")
    return "\n".join(lines)


def _short(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.3g}"
    if isinstance(x, dict):
        return ", ".join(f"{k}: {_short(v)}" for k, v in x.items())
    return str(x)


def _speed_markdown(cases: dict[str, dict[str, Any]]) -> list[str]:
    def res(name: str) -> dict[str, Any]:
        return cases.get(name, {}).get("result") or {}

    weights, bw = res("speed/weights"), res("speed/bandwidth")
    if not any(k.startswith("speed/") for k in cases):
        return []
    lines = [f"## Speed: random weights, {weights.get('shape', '?')} shape, {weights.get('dtype', '?')}", ""]
    bound = None
    if weights and bw:
        bound = weights["weight_bytes"] / bw["gb_per_s"] / 1e6
        lines += [f"- weights read per token {weights['weight_bytes'] / 1e6:.1f} MB; bandwidth {bw['gb_per_s']:.0f} "
                  f"GB/s ({bw['method']}); bound {bound:.3f} ms/token", ""]
    lines += ["| decoder | how | ms/token | tokens/s | of bandwidth |", "|---|---|---|---|---|"]
    for d in DECODERS:
        c = cases.get(f"speed/decode/{d}")
        if c is None:
            continue
        r = c.get("result") or {}
        if not r:
            lines.append(f"| {d} | {c['status']} | | | |")
            continue
        frac = f"{bound / r['ms_per_token']:.0%}" if bound else ""
        lines.append(f"| {d} | {r.get('how', '')} | {r['ms_per_token']:.2f} | {r['tokens_per_s']:.1f} | {frac} |")
    ver = {"eager": res("speed/verification/eager"), "compiled": {"ms": {}, "ratio": {}}}
    for k, c in cases.items():
        if k.startswith("speed/verification/compiled/") and c.get("result"):
            for part in ("ms", "ratio"):
                ver["compiled"][part].update(c["result"][part])
    ks = list(dict.fromkeys(k for v in ver.values() for k in v.get("ms", {})))
    if ks:
        lines += ["", "| k new tokens | eager ms | eager / k=1 | compiled ms | compiled / k=1 |",
                  "|---|---|---|---|---|"]
        for k in ks:
            cells = []
            for m in ("eager", "compiled"):
                v = ver[m]
                cells += [f"{v['ms'][k]:.2f}", f"{v['ratio'][k]:.2f}"] if k in v.get("ms", {}) else ["", ""]
            lines.append(f"| {k} | " + " | ".join(cells) + " |")
    batches = {k: c for k, c in cases.items() if k.startswith("speed/batch/")}
    if batches:
        lines += ["", "| greedy, batched (eager) | tokens/s, all slots | ms per step | tokens/s per slot |",
                  "|---|---|---|---|"]
        for k, c in batches.items():
            r = c.get("result") or {}
            lines.append(f"| {r['slots']} slots | {r['tokens_per_s']:.1f} | {r['ms_per_step']:.2f} | "
                         f"{r['tokens_per_s'] / r['slots']:.1f} |" if r else f"| {k} | {c['status']} | | |")
    drafts = {k.rsplit("/", 1)[1]: v for k, v in cases.items() if k.startswith("speed/drafting/")}
    if drafts:
        lines += ["", "| strategy | drafting ms/step | target step ms | draft / target |", "|---|---|---|---|"]
        for name, c in drafts.items():
            r = c.get("result") or {}
            if r:
                lines.append(f"| {name} | {r['draft_ms']:.2f} | {r['step_ms']:.2f} | {r['draft_to_step']:.3f} |")
            else:
                lines.append(f"| {name} | {c['status']} | | |")
    return [*lines, ""]

