"""The extraction's settings: one typed object, defined here once. ``eagle3kit extract`` builds its options from it
(``add_arguments``/``from_args``), notebook 03 builds it from its parameters, the params check runs its checks
before any step of a pipeline starts (``eagle3kit.runner``), and ``pipeline.run_extraction`` reads it."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields

from eagle3kit.setting_types import fits, markdown_table, setting

ENGINES = ("transformers", "sglang")
STORAGES = ("bf16", "fp8")


@dataclass
class ExtractConfig:
    target: str = setting("embedded:smollm2", "embedded:<name> or a Hugging Face model folder")
    data: str = setting("embedded:sharegpt", "a JSONL/JSON file (OpenAI messages or ShareGPT conversations) or "
                                        "embedded:sharegpt")
    out_dir: str = setting("outputs/extract", "the data set's folder", flag="--out", required=True)
    engine: str = setting("transformers", "transformers (CPU reference) or sglang (a GPU capture server)", choices=ENGINES)
    urls: list = setting([], "capture servers (sglang engine); none: start one", nargs="*")
    aux_layer_ids: list | None = setting(None, "aux layers, input_of_layer convention; none given: EAGLE-3's usual three",
                                    flag="--layers", nargs="+", type=int)
    max_samples: int | None = setting(None, "conversations to capture; none given: all")
    max_tokens: int = setting(2048, "the longest sample kept (longer conversations are cut)")
    storage: str = setting("bf16", "bf16 (speculators' layout) or fp8 (aux slots e4m3 + per-token scales, last slot bf16)",
                      choices=STORAGES)
    concurrency: int = setting(64, "capture requests in flight (sglang engine)")
    world_size: int = setting(1, "shards of the data set (each its own --out)")
    rank: int = setting(0, "this shard")
    final_normed: bool = setting(False, "also store the normed final state (SpecForge)")
    prefill_graph: bool = setting(False, "sglang engine: keep SGLang's prefill CUDA graph on and capture through its "
                                    "EAGLE-3 aux states (an SGLang plugin, installed with eagle3kit); the last slot is "
                                    "then the final norm's output")
    regenerate: bool = setting(False, "replace assistant turns with the target's own greedy replies first (kept for "
                                 "resumes)")
    regenerate_max_new_tokens: int = setting(256, "longest reply the target writes")
    regenerate_minutes: float | None = setting(None, "time budget of --regenerate: no conversation starts after it, those "
                                                "regenerated are captured and the rest counted as skipped (a rerun "
                                                "with a larger budget adds them); 0: cached replies only; default: no "
                                                "budget")
    regenerate_servers: int = setting(1, "engine sglang: servers writing the replies on the GPU, the capture server and "
                                    "plain servers on --port + 11, + 12, ... (one scheduler's CPU binds "
                                    "regeneration), each with --concurrency in flight")
    seed: int = setting(0, "seed of the train/held-out split")
    heldout_percent: float = setting(5.0, "share of conversations held out (by a seeded hash of their id)")
    port: int = setting(30000, "port of the SGLang server started here")
    reference_device: str = setting("cpu", "transformers engine: cpu or cuda")
    reference_dtype: str = setting("float32", "transformers engine: float32 or bfloat16", choices=("float32", "bfloat16"))
    reference_batch_tokens: int | None = setting(None, "transformers engine: prompts of similar length in one padded "
                                                  "forward of at most N tokens (0: one prompt per forward); default "
                                                  "16384 on cuda, 0 on cpu", metavar="N")
    server_args: list = setting([], "SGLang flags for the server started here (sglang engine, no --urls); last on the "
                               "line", nargs=argparse.REMAINDER)
    progress: bool = setting(True, "a progress line while capturing", cli=False)

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_dict(cls, d: dict) -> "ExtractConfig":
        """From settings as a notebook, params or a caller give them: unknown keys and wrong types are refused, naming
        the key; then ``validate``."""
        unknown = sorted(set(d) - set(cls.names()))
        if unknown:
            raise ValueError(f"unknown extraction settings {unknown}; known: {cls.names()}")
        # folders given as Paths, lists as tuples: the same settings
        d = {k: os.fspath(v) if isinstance(v, os.PathLike) else list(v) if isinstance(v, tuple) else v
             for k, v in d.items()}
        for f in fields(cls):
            if f.name in d and not fits(d[f.name], f.type):
                raise ValueError(f"extraction setting {f.name}={d[f.name]!r}: expected {f.type}")
        return cls(**d).validate()

    def validate(self) -> "ExtractConfig":
        """The checks that need no target (those that do, the layer ids against its depth, are
        ``pipeline.check_extraction_settings``'): each names the option and the fix."""
        def need(ok, msg):
            if not ok:
                raise ValueError(msg)
        need(self.engine in ENGINES, f"engine {self.engine!r}: choose 'transformers' (CPU reference) or 'sglang' "
                                     f"(GPU server)")
        need(self.storage in STORAGES, f"--storage {self.storage}: choose bf16 or fp8")
        need(not (self.prefill_graph and self.engine != "sglang"),
             "--prefill-graph is a capture option of the sglang engine (SGLang's prefill CUDA graph); the transformers "
             "engine has none. Fix: drop --prefill-graph or use --engine sglang")
        need(not (self.prefill_graph and self.final_normed),
             "--final-normed with --prefill-graph: the last slot already is the final norm's output there. Fix: drop "
             "--final-normed")
        need(self.reference_batch_tokens is None or self.reference_batch_tokens >= 0,
             f"--reference-batch-tokens {self.reference_batch_tokens}: give 0 (one prompt per forward) or a positive "
             f"token budget per forward")
        need(self.max_tokens >= 2, f"--max-tokens {self.max_tokens}: a sample needs at least 2 tokens (give the "
                                   f"longest sample to keep, e.g. 2048)")
        need(self.max_samples is None or self.max_samples >= 1,
             f"--max-samples {self.max_samples}: give a positive number (or omit it for every conversation)")
        need(0 <= self.heldout_percent < 100, f"--heldout-percent {self.heldout_percent}: a share in [0, 100)")
        need(self.regenerate_servers >= 1,
             f"--regenerate-servers {self.regenerate_servers}: give a whole number >= 1 (1: the capture server alone)")
        need(self.regenerate_servers == 1 or (self.engine == "sglang" and not self.urls),
             f"--regenerate-servers {self.regenerate_servers}: more regeneration servers start beside a capture "
             f"server that eagle3kit starts (--engine sglang without --urls); with --urls, give more --urls instead")
        need(self.concurrency >= 1 and self.regenerate_max_new_tokens >= 1,
             f"--concurrency {self.concurrency} / --regenerate-max-new-tokens {self.regenerate_max_new_tokens}: give "
             f"positive numbers")
        need(self.regenerate_minutes is None or self.regenerate_minutes >= 0,
             f"--regenerate-minutes {self.regenerate_minutes}: give minutes >= 0 (0: only replies already cached), "
             f"or omit it")
        need(self.world_size >= 1 and 0 <= self.rank < self.world_size,
             f"--rank {self.rank} --world-size {self.world_size}: give 0 <= rank < world size")
        return self

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """``eagle3kit extract``'s options, one per field (``progress`` excepted)."""
        for f in fields(cls):
            m = dict(f.metadata)
            if not m.pop("cli", True):
                continue
            flag = m.pop("flag", None) or "--" + f.name.replace("_", "-")
            kw = {k: v for k, v in m.items() if v is not None}
            default = f.default_factory() if callable(f.default_factory) else f.default
            if str(f.type) == "bool":
                parser.add_argument(flag, dest=f.name, action="store_true", help=kw["help"])
                continue
            if "choices" not in kw:  # argparse shows the choices themselves
                kw.setdefault("metavar", flag.lstrip("-").upper().replace("-", "_"))
            if "type" not in kw and "nargs" not in kw:
                kw["type"] = {"int": int, "float": float}.get(str(f.type).split(" |")[0], str)
            if not kw.get("required"):
                kw["default"] = default
            parser.add_argument(flag, dest=f.name, **kw)

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> "ExtractConfig":
        return cls.from_dict({k: getattr(a, k) for k in cls.names() if hasattr(a, k)})


def settings_table() -> str:
    """docs/settings.md's extraction table, made from the fields (tests/test_extract_config.py keeps the file equal)."""
    return markdown_table(ExtractConfig, "eagle3kit extract", lambda f: None if not f.metadata.get("cli", True)
                          else f.metadata.get("flag") or "--" + f.name.replace("_", "-"))
