"""Everything vLLM-specific, in one place: the served model (``model.py``) with its KV-cache layers,
backend and step metadata (``attention.py``), the compile-ready module vLLM compiles (``compiled.py``),
the Deployment read from a VllmConfig (``deployment.py``) and the ``vllm.general_plugins`` entry point
(``plugin.py``). It depends on ``minimax_ops`` and ``graph_passes``; neither imports it.

Importing this package registers the pass's vLLM deployment reader.
"""

from . import deployment  # noqa: F401  (registers the decode pass's deployment reader)
