"""pd-router: an OpenAI-compatible prefill/decode disaggregation router for vLLM."""

__version__ = "0.1.0"
__all__ = ["__version__"]
