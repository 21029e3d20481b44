"""The models: the language model and its builder (lm), one file per block family, fast
generation (decode) and int8 (quant). `MambaLM` and `build_model` are re-exported here."""
from sonata.model.lm import MambaLM, build_model

__all__ = ["MambaLM", "build_model"]
