"""Text-only processor for eagle3kit's tiny Kimi-K2.5 (loaded by AutoProcessor through processor_config.json's
auto_map, with trust_remote_code).

SGLang 0.5.14 treats KimiK25ForConditionalGeneration as multimodal and builds its own Kimi processor
(multimodal/processors/kimi_k25.py, KimiK2_5VLImageProcessor) around whatever AutoProcessor returns. That constructor
reads ``.tokenizer``, ``.image_processor`` and ``.media_processor.media_proc_cfg`` (patch_size, merge_kernel_size,
in_patch_limit, patch_limit_on_one_side, image_mean, image_std, optionally fixed_output_tokens). This class supplies
exactly those; text goes through the tokenizer, media input is refused (the tiny model has no vision weights).
"""
import json
import os

from transformers import AutoTokenizer

DEFAULT_MEDIA_PROC_CFG = {
    "patch_size": 14, "merge_kernel_size": 2, "in_patch_limit": 256, "patch_limit_on_one_side": 16,
    "fixed_output_tokens": None, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
}


class KimiK25TinyMediaProcessor:
    """Carries media_proc_cfg (what SGLang reads); does no image work."""

    def __init__(self, media_proc_cfg=None):
        self.media_proc_cfg = {**DEFAULT_MEDIA_PROC_CFG, **(media_proc_cfg or {})}

    def __call__(self, *args, **kwargs):
        raise NotImplementedError("eagle3kit's tiny Kimi-K2.5 is text-only: it has no vision weights")


class KimiK25TinyProcessor:
    """A text-only stand-in for Kimi-K2.5's KimiK25Processor."""

    attributes = ["tokenizer"]

    def __init__(self, tokenizer, media_proc_cfg=None):
        self.tokenizer = tokenizer
        self.image_processor = None
        self.media_processor = KimiK25TinyMediaProcessor(media_proc_cfg)

    @property
    def chat_template(self):
        return getattr(self.tokenizer, "chat_template", None)

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoProcessor"):  # AutoProcessor calls it on remote classes
        pass

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, trust_remote_code=False, **kwargs):
        path = str(pretrained_model_name_or_path)
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code,
                                                  revision=kwargs.get("revision"))
        cfg = None
        proc_json = os.path.join(path, "processor_config.json")
        if os.path.isfile(proc_json):
            with open(proc_json, encoding="utf-8") as f:
                cfg = json.load(f).get("media_proc_cfg")
        return cls(tokenizer, cfg)

    def __call__(self, text=None, images=None, medias=None, return_tensors="pt", **kwargs):
        if images or medias or kwargs.get("videos"):
            raise NotImplementedError("eagle3kit's tiny Kimi-K2.5 is text-only: it has no vision weights")
        return self.tokenizer(text, return_tensors=return_tensors, **kwargs)
