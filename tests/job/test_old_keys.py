"""What earlier versions wrote still reads: a job checkpoint's flat config keys (``--h auto`` as
``"auto"``, the codec's options under ``[transport]``) and the committed ``auto_table.json``."""

import json
from pathlib import Path

from diloco.job import auto_choice as ac
from diloco.job.config import Config
from diloco.job.config_parse import from_dict

DATA = Path(__file__).with_name("data")


def _old(name: str) -> dict:
    return json.loads((DATA / name).read_text())["config"]


def test_an_old_checkpoints_config_reads_as_the_same_settings_and_writes_the_same_keys():
    old = _old("checkpoint_config_4c369af.json")
    cfg = from_dict(old).validate()
    t = cfg.transport
    assert (t.codec, t.codec_block, t.zstd, t.final_codec, cfg.sync.h, cfg.sync.schedule) == \
        ("int2", 1024, True, "int4", 200, "paced")
    assert t.codec_spec().build().params["block_size"] == 1024
    written = cfg.to_dict()
    for section, values in old.items():
        for key, value in values.items():
            assert written[section][key] == value, (section, key)
    new_keys = {(s, k) for s, v in written.items() for k in v} - {(s, k) for s, v in old.items() for k in v}
    for section, key in new_keys:  # options added since: at the defaults that give the old behaviour
        assert written[section][key] == Config().to_dict()[section][key]


def test_an_old_auto_jobs_config_reads_as_auto():
    cfg = from_dict(_old("auto_config_4c369af.json")).validate()
    assert ac.is_auto(cfg) == (True, True) and cfg.sync.h == "auto"
    assert cfg.to_dict()["sync"]["h"] == "auto" and cfg.to_dict()["transport"]["codec"] == "auto"


def test_the_committed_auto_table_reads_and_every_setting_builds():
    table = ac.load_table()
    raw = json.loads(ac.TABLE_PATH.read_text())
    assert len(table.entries) == len(raw["entries"]) > 0
    base = Config()
    base.transport.codec, base.sync.h = "auto", ac.AUTO_H
    for entry in table.entries:
        cfg = ac.apply_choice(base, entry)
        assert cfg.transport.codec_spec().problems() == [], entry.row
        assert entry.codec_spec(base.transport.codec_spec()) == cfg.transport.codec_spec(), entry.row
        assert (cfg.transport.codec, cfg.sync.h, cfg.transport.codec_block, cfg.transport.zstd) == \
            (entry.codec, entry.h, entry.codec_options.codec_block, entry.codec_options.zstd)
