"""Bridges to other libraries. Each submodule is optional and imported on its own, e.g.
``import moekit.integrations.transformers`` (needs ``pip install 'moekit[hf]'``)."""
