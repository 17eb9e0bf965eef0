"""The live stream's settings: one typed object, read by ``eagle3kit train --live``, notebook 04's ``live``
parameter and the params check (``TrainConfig.live`` holds it as a dict; ``LiveConfig.from_dict`` checks it)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

ENGINES = ("transformers", "sglang")


class LiveError(ValueError):
    pass


@dataclass
class LiveConfig:
    engine: str = "transformers"  # transformers (the reference engine, in this process: CPU demo and tests) or sglang
    urls: list = field(default_factory=list)  # running capture servers (sglang); their capture folder is the stream's
    server_args: list = field(default_factory=list)  # sglang without urls: a capture server started with these
    port: int = 30000  # of the capture server started here
    aux_layer_ids: list | None = None  # input_of_layer; None: EAGLE-3's usual three for the target
    max_samples: int | None = None  # conversations taken from the data set (None: all)
    max_tokens: int = 2048  # longest sample kept (longer conversations are cut, as extract does)
    heldout_percent: float = 5.0  # conversations held out (the same seeded rule as extract: the same split)
    split_seed: int = 0
    heldout_max_samples: int = 64  # held-out samples captured once and kept in host RAM for the evaluations
    storage: str = "bf16"  # how samples cross the stream (bf16, or fp8: about 0.6 of the bytes)
    stream_gb: float = 2.0  # bound on the hidden-state bytes in the stream: asked for + buffered, not yet trained on
    concurrency: int = 64  # capture requests in flight at the servers
    cache_gb: float = 0.0  # epochs after the first: 0 captures every sample again; > 0 keeps up to this many GB of
    # the first epoch's samples in host RAM and captures only the rest
    stream_dir: str = ""  # a folder on a RAM filesystem (tmpfs) that the samples cross; "": /dev/shm/eagle3kit-live-*
    regenerate: bool = False  # the target writes the replies first (as extract --regenerate); kept in out_dir
    regenerate_max_new_tokens: int = 256
    prefill_graph: bool = False  # sglang: capture inside SGLang's prefill CUDA graph (last slot post-norm)
    reference_device: str = "cpu"  # transformers engine
    relay_port: int = 0  # > 0: the urls' servers run on other hosts, each beside an `eagle3kit relay` sender that
    # moves its captures here through torch.distributed (gloo/TCP); training rank r receives on relay_port + r
    relay_senders: int = 1  # how many relay senders (capture hosts) feed each training rank
    timeout_s: float = 600.0  # a sample the trainer waits for longer than this stops the run, with the stream's state
    max_attempts: int = 5  # captures of one sample (failed or rejected) before the run stops, naming it

    def validate(self) -> "LiveConfig":
        def need(ok, what):
            if not ok:
                raise LiveError(f"live setting {what}")
        need(self.engine in ENGINES, f"engine={self.engine!r}: choose one of {ENGINES}")
        need(self.storage in ("bf16", "fp8"), f"storage={self.storage!r}: choose bf16 or fp8")
        need(self.stream_gb > 0, f"stream_gb={self.stream_gb}: give the stream's bound in GB (> 0)")
        need(self.cache_gb >= 0, f"cache_gb={self.cache_gb}: give GB >= 0 (0: capture again every epoch)")
        need(self.concurrency >= 1, f"concurrency={self.concurrency}: give a positive number")
        need(self.max_samples is None or self.max_samples >= 1, f"max_samples={self.max_samples}: a positive "
             f"number, or None for every conversation")
        need(self.max_tokens >= 2, f"max_tokens={self.max_tokens}: a sample needs at least 2 tokens")
        need(0 <= self.heldout_percent < 100, f"heldout_percent={self.heldout_percent}: a share in [0, 100)")
        need(self.heldout_max_samples >= 0, f"heldout_max_samples={self.heldout_max_samples}: give >= 0")
        need(self.timeout_s > 0 and self.max_attempts >= 1, "timeout_s > 0 and max_attempts >= 1")
        need(not (self.urls and self.server_args), "urls and server_args together: give running servers (urls) or "
             "the arguments of one to start (server_args), not both")
        need(self.engine == "sglang" or not (self.urls or self.server_args or self.prefill_graph),
             "urls / server_args / prefill_graph are the sglang engine's: set engine=sglang")
        need(self.relay_port >= 0 and self.relay_senders >= 1, f"relay_port={self.relay_port}, relay_senders="
             f"{self.relay_senders}: a port (0: no relay) and at least one sender")
        need(not self.relay_port or (self.urls and self.stream_dir), "relay_port without urls and stream_dir: the "
             "relay brings the captures of running servers on other hosts (urls) into stream_dir's samples/")
        need(self.aux_layer_ids is None or (list(self.aux_layer_ids) == sorted(set(self.aux_layer_ids))),
             f"aux_layer_ids={self.aux_layer_ids}: distinct and increasing")
        return self

    @classmethod
    def from_dict(cls, d: dict | None) -> "LiveConfig":
        if not isinstance(d, dict):
            raise LiveError(f"live={d!r}: give the live stream's settings as a mapping (e.g. {{engine: sglang}})")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise LiveError(f"unknown live settings {unknown}; known: {sorted(known)}")
        kinds = {"engine": str, "storage": str, "stream_dir": str, "reference_device": str, "urls": list,
                 "server_args": list, "regenerate": bool, "prefill_graph": bool}
        for k, v in d.items():
            want = kinds.get(k)
            if want is not None and not isinstance(v, want):
                raise LiveError(f"live setting {k}={v!r}: expected {want.__name__}")
            if want is None and v is not None and k != "aux_layer_ids" and (
                    isinstance(v, bool) or not isinstance(v, (int, float))):
                raise LiveError(f"live setting {k}={v!r}: expected a number")
        return cls(**d).validate()

    def as_dict(self) -> dict:
        return asdict(self)
