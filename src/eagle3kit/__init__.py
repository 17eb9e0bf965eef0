"""eagle3kit: train EAGLE-3 drafters from hidden states captured inside a running SGLang server."""
from eagle3kit.metrics import quiet_batch_run, record, step_dir

quiet_batch_run()

__version__ = "0.1.0"
__all__ = ["record", "step_dir", "__version__"]
