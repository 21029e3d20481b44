"""Other people's Mamba code: transformers export and import (hf), transformers' Mamba models on
sonata's kernels (hf_accelerate), and mamba_ssm's op names and signatures served by sonata's
kernels (mamba_ssm, with `install()` for code that imports mamba_ssm itself)."""
