"""`python -m heads.train head=NAME`: train a drafter on the frozen target's own greedy continuations.

Interface for a trainable drafter (`configs/head/NAME.yaml`, whose `_target_` builds one)::

    class Trainable(Protocol):
        name: str                # names the output folder: heads/checkpoints/MODEL-NAME/
        needs_hidden: bool       # True: loss() reads target_hidden; False: the trainer skips the target pass

        def build(self, target: LoadedModel, data: datasets.Dataset) -> nn.Module:
            # The trainable module. The target stays frozen; the module may share its tensors (embedding,
            # output head) as frozen parameters: the optimizer only sees parameters with requires_grad.
            # `data` is the training set (columns below), e.g. to pick a reduced vocabulary. Must be
            # deterministic given (target, data, config): resuming rebuilds it and loads the checkpoint.

        def loss(self, module: nn.Module, batch: dict[str, Tensor],
                 target_hidden: Tensor | None) -> tuple[Tensor, dict[str, float]]:
            # batch: input_ids (B, T), labels (B, T), attention_mask (B, T); right-padded.
            #   labels[b, t] is the token that follows input_ids[b, t] in the self-distilled sequence,
            #   -100 where nothing should be learnt (the prompt, padding, the last token).
            # target_hidden: (B, T, D) final-norm hidden states of the frozen target for input_ids
            #   (computed by the trainer, cached on disk with `train.cache_hidden`), None unless needs_hidden.
            # Returns the scalar loss and floats to log (e.g. {"acc": ...}).

        def save(self, module: nn.Module, out_dir: Path, meta: dict[str, Any]) -> None:
            # The shipped artifact: safetensors weights + a JSON config. `meta` carries base_model,
            # hidden_size, vocab_size, target_folder, steps, loss...; write them so a loader can refuse
            # another model with a clear error.

The trainer (`train`) owns data, device placement and mixed precision (accelerate), the optimizer,
logging (logger=wandb|none), the time budget (`train.max_minutes`) and resumable checkpoints
(trainable parameters + optimizer state in safetensors, counters in JSON, under OUTPUT/checkpoints/).
"""
