"""Model parallelism for the step engine. Process groups are always passed in, never global."""

from stepserve.engine.parallel.latent import cfg_split_denoise
from stepserve.engine.parallel.ulysses import UlyssesLayout, UlyssesWanAttnProcessor, UlyssesWanTransformer, even_split

__all__ = ["UlyssesLayout", "UlyssesWanAttnProcessor", "UlyssesWanTransformer", "cfg_split_denoise", "even_split"]
