"""Engine integrations: trimpass's trimmed LM head served by an inference engine.

:mod:`trimpass.serving.head` computes a batch of requests' logits over their own active ids with
one shared compact matmul (the union of the rows' ids, on one vocabulary shard), importing no
engine. :mod:`trimpass.serving.vllm` is the public face of the vLLM integration (``engine_args``,
``stats``, the ``vllm.general_plugins`` entry point); :mod:`trimpass.serving.vllm_compat` is the
one module that touches vLLM (every symbol recorded with its reason), and
:mod:`trimpass.serving.vllm_state` holds each drafter's state in trimpass's own registry. Nothing
here is imported by the core.
"""
