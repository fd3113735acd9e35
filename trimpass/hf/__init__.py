"""Hugging Face glue: the real Gemma-3-270M from its GGUF and its tokenizer
(:mod:`~trimpass.hf.gemma`), and assisted generation timed from the outside
(:mod:`~trimpass.hf.assisted`)."""
