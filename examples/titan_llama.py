"""torchtitan's debug Llama trained by torchtitan, its data-parallel ranks one DiLoCo group (FSDP2 inside).

Every rank of a group runs this script under ``torchrun``; one ``torchrun`` per group, a coordinator
beside them::

    pip install -e ".[titan]"
    diloco coordinator --port 29400 --groups 2 &
    export DILOCO_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')
    torchrun --standalone --nproc-per-node 2 examples/titan_llama.py --diloco.coordinator 127.0.0.1:29400 --diloco.group 0 &
    torchrun --standalone --nproc-per-node 2 examples/titan_llama.py --diloco.coordinator 127.0.0.1:29400 --diloco.group 1

The arguments are torchtitan's (``ConfigManager``): ``--config`` a function of
``diloco.integrations.titan`` (default ``llama3_debugmodel_diloco``; ``llama3_debugmodel_dp`` is
torchtitan's own Trainer alone, the data-parallel baseline, no coordinator), then ``--section.key
value`` overrides: ``--training.steps 100 --diloco.sync_every 25 --diloco.codec int8
--checkpoint.enable --dump_folder /tmp/titan`` (checkpoints: torchtitan's DCP under
``DUMP_FOLDER/checkpoint``), ``--diloco.summary_json PATH`` (the group's summary). The lines between
the two ``# --- diloco`` markers are all the glue there is.
"""

from __future__ import annotations

import json
import sys

import torch.distributed as dist

import diloco
from diloco.integrations import titan


def main(argv: list[str]) -> None:
    config = titan.parse_config(argv)
    # --- diloco: the averager, connected once torchtitan has started the group's process group ------
    section = getattr(config, "diloco", None)
    if section is None:  # llama3_debugmodel_dp: torchtitan's Trainer alone
        trainer = config.build()
    else:
        connect = None
        if section.groups > 1:
            def connect() -> diloco.GroupConnection:
                settings = diloco.TransportConfig(**({"probe_bytes": section.probe_bytes} if section.probe_bytes >= 0 else {}))
                return diloco.connect(section.coordinator, group=section.group, codec=section.codec, settings=settings)
        trainer = config.build(connect=connect)
    # --- diloco ------------------------------------------------------------------------------------
    try:
        trainer.train()
    finally:
        trainer.close()
    summary = getattr(trainer, "summary", None)
    if summary and dist.get_rank() == 0:
        print(json.dumps({k: summary.get(k) for k in ("group", "outer_rounds", "bytes_sent", "param_hash",
                                                      "eval_loss", "initial_eval_loss", "num_parameters")}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
