"""The summary's codec line: what ``--codec`` ran between the groups, as the job's config says."""

from diloco.job.config import Config
from diloco.runtime.launch import summary

BASE = {"eval_loss": 2.0, "initial_eval_loss": 5.0, "mode": "blocking", "fragments": 1, "outer_rounds": 1,
        "periods": [10], "inner_steps": 10, "groups": 2, "ranks_per_group": [1, 1], "num_parameters": 10,
        "bytes_sent": 1, "dp_bytes": 2, "reduction_vs_dp": 2.0, "params_identical": True,
        "param_hash_per_group": {"0": "a", "1": "a"}, "utilization": 1.0, "seconds": 1.0, "run_dir": "/x"}


def codec_line(residual_decay: float = 1.0, **transport) -> str:
    config = Config().to_dict()
    config["transport"].update(transport)
    config["outer"]["residual_decay"] = residual_decay
    lines = summary.format_summary({**BASE, "config": config}).splitlines()
    found = [x for x in lines if x.startswith("  codec between groups")]
    assert len(found) == 1 and lines.index(found[0]) == 1 + lines.index(
        next(x for x in lines if x.startswith("  sync mode"))), lines
    return found[0].split(": ", 1)[1]


def test_the_codec_line_names_the_codec_its_block_zstd_its_residual_decay_and_the_last_exchange():
    assert codec_line() == "fp32"
    assert codec_line(codec="int2", codec_block=1024, final_codec="int8") == \
        "int2 (--codec-block 1024), the last exchange int8 (--final-codec)"
    assert codec_line(codec="topk", topk_density=0.03, zstd=True) == "topk (density 0.03) + zstd"
    assert codec_line(codec="int2", final_codec="int4", residual_decay=0.0) == \
        "int2, residual decay 0 (--residual-decay), the last exchange int4 (--final-codec)"


def test_a_summary_without_its_config_has_no_codec_line():
    assert "codec between groups" not in summary.format_summary(dict(BASE))
