"""kvdisagg: prefill/decode disaggregated serving for vLLM.

The package has three parts that share nothing but the wire protocol:
``connector/`` (loaded inside vLLM), ``transport/`` (moves KV bytes between workers) and
``proxy/`` (the OpenAI-compatible front door that performs the handoff).
"""

__version__ = "0.1.0"
