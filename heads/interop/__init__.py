"""Checkpoints in and out of specdec in other projects' published layouts.

In: Medusa heads in FasterDecoding's layout (`medusa_layout.load_fasterdecoding_heads`) and EAGLE-1/2
drafters in SafeAILab's (`eagle_layout.load_eagle_layout`), from a local folder or, only when asked
(`hub=true`), a Hugging Face hub id (`hub.resolve_source`). Both are strategy-config entries:
`strategy.heads._target_=heads.interop.medusa_layout.load_fasterdecoding_heads` and
`strategy.drafter._target_=heads.interop.eagle_layout.load_eagle_layout`. EAGLE-3 folders are read,
checked and refused in one line (specdec's drafter cannot compute them).

Out: `python -m heads.export {medusa,eagle,draft} CHECKPOINT_DIR --out DIR` (heads/export.py).
docs/interop.md says what each layout holds and how vLLM and SGLang run the exports.
"""
