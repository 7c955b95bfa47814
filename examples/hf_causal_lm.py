"""A Hugging Face ``transformers`` causal LM through ``diloco run --entry``, written back with ``save_pretrained``.

    pip install -e ".[hf]"
    diloco run --entry examples.hf_causal_lm:make_task --entry-args config=llama-tiny,save_pretrained=/tmp/hf-out \\
        --groups 2 --ranks-per-group 2 --parallel fsdp --steps 200 --h 50 --inner-lr 3e-3 --batch-size 8

(run from the repository root, or put this folder's parent on PYTHONPATH). The model is built from
a config, nothing is downloaded: ``config`` is a preset (``llama-tiny``, ``gpt2-tiny``), a
``config.json`` or a directory holding one (a ``save_pretrained`` output), ``config.KEY=VALUE``
changes one field (``config.hidden_size=128``); ``block`` is the sequence length (default 64). The
text is the bundled Shakespeare, or the text files ``--data DIR`` holds, byte-level tokens (ids
0..255, no tokenizer files). ``--parallel fsdp`` shards each group's model by its decoder layers
(FSDP2), otherwise every rank holds it whole (DDP). With ``save_pretrained=DIR`` group 0 writes the
final global model there (safetensors), which ``transformers.AutoModelForCausalLM.from_pretrained(DIR)``
reads back unchanged.
"""

from __future__ import annotations

import diloco
from diloco.integrations import hf


def make_task(ctx: diloco.TaskContext) -> diloco.Task:
    """The entry point ``diloco worker`` calls in every rank of every group."""
    return hf.causal_lm_task(ctx)
