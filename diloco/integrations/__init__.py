"""Other ecosystems' models and formats as diloco workloads: ``hf`` builds a ``Task`` from a Hugging
Face ``transformers`` causal-LM config and writes the trained global model with ``save_pretrained``.
Each integration imports its ecosystem lazily (an optional extra: ``pip install -e ".[hf]"``), so the
base install and the rest of ``diloco`` never need it.
"""
