"""The training's settings: one typed object, defined here once. ``eagle3kit train`` reads it (``--set name=value``
over the fields, ``from_dict``), notebook 04 builds it from its parameters of the same names (``from_notebook``), the
params check runs its checks before any step of a pipeline starts (``eagle3kit.params``), docs/settings.md lists it
(``setting_types.markdown_table``), and ``drafter.train.train`` reads it."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from eagle3kit.drafter.objective import LOSSES
from eagle3kit.setting_types import fits, markdown_table, setting


class TrainError(ValueError):
    pass


@dataclass
class TrainConfig:
    data: str = field(metadata={"help": "an eagle3kit data set (its train split) or a speculators export; with live: "
                                        "the conversations", "flag": "--data"})
    out_dir: str = field(metadata={"help": "the run's folder (checkpoints, exports, logs)", "flag": "--out"})
    heldout: str | None = setting(None, "the held-out data set; none: the data set's held-out split")
    target: str | None = setting(None, "the target; none: the one the data set was captured from")
    aux_layer_ids: list[int] | None = setting(None, "input_of_layer ids, only for sources that do not record them")
    draft_vocab_size: int = setting(32000, "the draft vocabulary (the most frequent loss tokens)")
    num_layers: int = setting(1, "draft decoder layers (SGLang serves 1)")
    ttt_steps: int = setting(7, "TTT steps unrolled in training")
    step_decay: float = setting(0.8, "weight of TTT step k: step_decay ** k (speculators 1.0, SpecForge/EAGLE 0.8)")
    loss: str = setting("ce_masked", "ce_masked (SpecForge/EAGLE) or kl (speculators)")
    lm_head: str = setting("trained", "trained (SpecForge/EAGLE) or frozen to the target's rows (speculators)")
    drafter: str = setting("llama", "llama (SGLang's LlamaForCausalLMEagle3) or mla (Eagle3DeepseekV2ForCausalLM)")
    eagle31: bool = setting(False, "EAGLE-3.1: fc_norm and norm_output both on")
    fc_norm: bool = setting(False, "a norm after fc (EAGLE-3.1)")
    norm_output: bool = setting(False, "the next step reads the normed output (EAGLE-3.1)")
    mla_num_attention_heads: int | None = setting(None, "drafter=mla: heads; none: the target's own (an MLA target)")
    mla_q_lora_rank: int | None = setting(None, "drafter=mla: q LoRA rank; none: the target's own")
    mla_kv_lora_rank: int | None = setting(None, "drafter=mla: kv LoRA rank; none: the target's own")
    mla_qk_nope_head_dim: int | None = setting(None, "drafter=mla: no-RoPE head dim; none: the target's own")
    mla_qk_rope_head_dim: int | None = setting(None, "drafter=mla: RoPE head dim; none: the target's own")
    mla_v_head_dim: int | None = setting(None, "drafter=mla: value head dim; none: the target's own")
    allow_post_norm_final: bool = setting(False, "only to reproduce the mistake on purpose (acceptance experiment)")
    lr: float = setting(3e-4, "peak learning rate (AdamW)")
    weight_decay: float = setting(0.0, "AdamW weight decay")
    warmup_ratio: float = setting(0.02, "share of the steps warming up")
    min_lr_ratio: float = setting(0.05, "the cosine's end, a share of lr")
    grad_clip: float = setting(0.5, "the gradients' global norm is clipped to this; 0: not clipped (still logged)")
    epochs: int = setting(1, "passes over the train split")
    max_steps: int = setting(0, "optimizer steps; 0: the epochs decide")
    tokens_per_batch: int = setting(8192, "tokens per packed row (samples packed; a longer one is cut)")
    rows_per_batch: int = setting(1, "packed rows per micro-batch, one forward (>1: each padded to tokens_per_batch; "
                                     "attention stays within a row)")
    grad_accum: int = setting(1, "micro-batches per optimizer step")
    seed: int = setting(0, "seed of the weights, the order and the validation samples")
    eval_every: int = setting(0, "optimizer steps between evaluations; 0: at the end of each epoch")
    eval_steps: int = setting(0, "chain depth evaluated; 0: ttt_steps")
    serving_steps: int = setting(3, "the best checkpoint is chosen by validation tau at this depth")
    val_percent: float = setting(5.0, "share of the train split's samples (seeded, by position) never trained on: they "
                                      "choose the best checkpoint, so the held-out tau reports a choice it took no "
                                      "part in; 0: best/ is the latest")
    val_max_samples: int = setting(256, "at most this many validation samples (each evaluation scores all of them, and "
                                        "a live training keeps them in host RAM); 0: no cap")
    save_every: int = setting(100, "optimizer steps between resume points")
    teacher_cache_gb: float = setting(0.5, "memory on the training device for the target's greedy token of each row "
                                           "trained on (4 bytes a row): later epochs compute only the draft "
                                           "vocabulary's columns of the target's head; 0: all of them every step")
    workers: int = setting(2, "DataLoader workers")
    device: str = setting("auto", "auto, cpu, cuda or cuda:N")
    attention: str = setting("auto", "sdpa (dense masks), flex (block-sparse, compiled: GPUs) or auto (flex on a GPU)")
    compile_layers: bool = setting(False, "torch.compile each draft decoder layer (fewer launches on a GPU); eager "
                                          "again, and said so, if its trial step fails")
    progress: bool = setting(True, "a progress line while training")
    max_minutes: float = setting(0.0, "wall-clock budget of the call, setup and the closing evaluation, save and "
                                      "export included; 0: none")
    fit_schedule: bool = setting(False, "with max_minutes: cut the planned steps to what fits (measured pace, "
                                        "evaluations included) so warmup + cosine end in time")
    live: dict | None = setting(None, "live training (eagle3kit.live.LiveConfig): data names conversations, captured "
                                      "while training, no hidden state on disk; none: data is a data set on disk",
                                flag="--live --live-set KEY=VALUE")

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def validate(self) -> "TrainConfig":
        def need(ok, what):
            if not ok:
                raise TrainError(f"train setting {what}")
        for name in ("lr", "weight_decay", "max_minutes", "step_decay", "grad_clip", "warmup_ratio", "min_lr_ratio",
                     "teacher_cache_gb"):
            need(math.isfinite(getattr(self, name)), f"{name}={getattr(self, name)}: must be a finite number")
        need(self.loss in LOSSES, f"loss={self.loss!r}: choose one of {LOSSES}")
        need(self.drafter in ("llama", "mla"), f"drafter={self.drafter!r}: choose 'llama' or 'mla'")
        need(self.drafter == "mla" or not any(v is not None for v in self.mla_overrides().values()),
             "mla_* settings apply to drafter=mla only: set drafter=mla or leave them unset")
        need(self.drafter == "llama" or self.num_layers == 1, f"num_layers={self.num_layers} with drafter=mla: "
             f"SGLang 0.5.14's Eagle3DeepseekV2ForCausalLM runs exactly one layer")
        need(self.attention in ("auto", "sdpa", "flex"), f"attention={self.attention!r}: choose auto, sdpa or flex")
        need(self.lm_head in ("trained", "frozen"), f"lm_head={self.lm_head!r}: choose 'trained' or 'frozen'")
        need(self.ttt_steps >= 1 and self.num_layers >= 1, "ttt_steps and num_layers must be >= 1")
        need(self.serving_steps >= 1, "serving_steps must be >= 1")
        need(self.teacher_cache_gb >= 0, f"teacher_cache_gb={self.teacher_cache_gb}: give GB >= 0 (0: no cache)")
        need(self.ttt_steps >= self.serving_steps, f"ttt_steps={self.ttt_steps} < serving_steps={self.serving_steps}: "
             f"positions past the TTT depth are never trained on the draft's own states; train at least as deep")
        need(self.lr > 0 and 0 <= self.warmup_ratio < 1 and 0 <= self.min_lr_ratio <= 1, "lr > 0, warmup_ratio in "
             "[0, 1), min_lr_ratio in [0, 1]")
        need(self.tokens_per_batch >= 16 and self.grad_accum >= 1 and self.epochs >= 1 and self.max_steps >= 0
             and self.rows_per_batch >= 1,
             "tokens_per_batch >= 16, rows_per_batch >= 1, grad_accum >= 1, epochs >= 1, max_steps >= 0")
        need(0 < self.step_decay <= 1, "step_decay in (0, 1]")
        need(self.draft_vocab_size >= 1, "draft_vocab_size >= 1")
        need(0 <= self.val_percent < 100, f"val_percent={self.val_percent}: give a share of the training samples in "
             f"[0, 100) to choose the best checkpoint on (0: none, best/ is the latest)")
        need(self.val_max_samples >= 0, f"val_max_samples={self.val_max_samples}: give >= 0 (0: no cap)")
        need(not self.fit_schedule or self.max_minutes > 0, "fit_schedule needs max_minutes > 0 (the budget to fit)")
        need(self.eval_depth >= self.serving_steps, f"eval_steps={self.eval_steps} < serving_steps="
             f"{self.serving_steps}: the best checkpoint is chosen by held-out tau at serving_steps, which an evaluation "
             f"this shallow does not measure; set eval_steps >= serving_steps (or 0: ttt_steps)")
        need(self.grad_clip >= 0, f"grad_clip={self.grad_clip}: give the gradient norm to clip to, or 0 for none")
        need(self.save_every >= 1 and self.eval_every >= 0, "save_every >= 1 (optimizer steps between resume points), "
             "eval_every >= 0")
        for name in ("weight_decay", "max_minutes", "eval_steps", "workers", "seed"):  # counts and budgets
            need(getattr(self, name) >= 0, f"{name}={getattr(self, name)}: must be >= 0"
                 + (" (0: no budget)" if name == "max_minutes" else ""))
        from eagle3kit.target import check_device

        try:
            check_device(self.device, "device", sep="=")
        except ValueError as e:
            raise TrainError(f"train setting {e}") from None
        if self.live is not None:
            from eagle3kit.live.config import LiveConfig, LiveError

            try:
                LiveConfig.from_dict(self.live)
            except LiveError as e:
                raise TrainError(str(e)) from None
        return self

    def mla_overrides(self) -> dict:
        """The ``mla_*`` settings without the prefix (None: the target's own)."""
        return {f.name[4:]: getattr(self, f.name) for f in fields(self) if f.name.startswith("mla_")}

    @property
    def use_fc_norm(self) -> bool:
        return self.fc_norm or self.eagle31

    @property
    def use_norm_output(self) -> bool:
        return self.norm_output or self.eagle31

    @property
    def eval_depth(self) -> int:
        """The chain depth an evaluation runs: ``eval_steps``, or ``ttt_steps`` when 0."""
        return self.eval_steps or self.ttt_steps

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise TrainError(f"unknown train settings {unknown}; known: {sorted(known)}")
        d = dict(d)
        for f in fields(cls):  # a value of the wrong type is a user's mistake, named before any comparison trips on it
            if f.name in d and isinstance(d[f.name], str) and "float" in str(f.type):
                try:  # YAML 1.1 reads 3e-4 (no dot) as a string; a user writes floats so, and the defaults print so
                    d[f.name] = float(d[f.name])
                except ValueError:
                    pass
            if f.name in d and not fits(d[f.name], f.type):
                raise TrainError(f"train setting {f.name}={d[f.name]!r}: expected {f.type}")
        return cls(**d).validate()


def from_notebook(params: dict, *, data: str, out_dir: str) -> TrainConfig:
    """Notebook 04's parameters (its globals) as the settings, checked whole: the fields of the same names, with the
    notebook's empty values read as the defaults (``target`` "" and ``live`` {}: none); ``data`` and ``out_dir`` as the
    notebook resolves them."""
    d = {k: v for k, v in params.items() if k in TrainConfig.names()}
    d.update(data=data, out_dir=out_dir, target=d.get("target") or None, live=dict(d.get("live") or {}) or None)
    return TrainConfig.from_dict(d)


def train_settings_table() -> str:
    """docs/settings.md's training table, made from the fields (tests/test_train_config.py keeps the file equal)."""
    return markdown_table(TrainConfig, "eagle3kit train", lambda f: f.metadata.get("flag") or f"--set {f.name}=VALUE")
