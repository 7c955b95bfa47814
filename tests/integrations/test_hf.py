"""Hugging Face causal LMs (``diloco.integrations.hf``): configs, corpus, sharding units, ``save_pretrained``
read back bit-identical, and the two examples run as written (``diloco run --entry`` with FSDP2 and DDP,
and the Python API) on tiny configs.

``transformers`` comes with the ``dev`` extra (``.[hf]``), so CI runs every test here; without it
they are skipped with the reason below, which names the extra.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason='the hf extra is not installed: pip install -e ".[hf]"')

from diloco import cli  # noqa: E402
from diloco.demo.data import EpochSampler  # noqa: E402
from diloco.engine.outer_state import params_hash  # noqa: E402
from diloco.integrations import hf  # noqa: E402
from diloco.job.data_source import is_data_source  # noqa: E402
from diloco.job.config import Config  # noqa: E402
from diloco.job.task import TaskContext  # noqa: E402
from diloco.runtime.checkpoints import checkpoint  # noqa: E402
from diloco_helpers import run_api_example  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RUN = ["run", "--no-progress", "--timeout", "90", "--probe-bytes", "0", "--batch-size", "4", "--eval-batches", "2"]


def context(tmp_path: Path, **args: str) -> TaskContext:
    (tmp_path / "corpus").mkdir(exist_ok=True)
    (tmp_path / "corpus" / "a.txt").write_text("To be, or not to be: that is the question. " * 40)
    (tmp_path / "corpus" / "b.txt").write_text("All the world's a stage, and all the men and women merely players. " * 40)
    return TaskContext(group=1, num_groups=2, rank=0, group_size=2, device=torch.device("cpu"), seed=3, steps=4,
                       batch_size=2, data_path=str(tmp_path / "corpus"), args=args)


def assert_reads_back(out_dir: Path, params: dict[str, torch.Tensor]) -> None:
    """``from_pretrained(out_dir)`` holds exactly ``params`` (every one of its parameters, bit for bit)."""
    back = transformers.AutoModelForCausalLM.from_pretrained(out_dir)
    own = dict(back.named_parameters())
    assert set(own) == set(params)
    for name, p in own.items():
        assert p.dtype == torch.float32 and torch.equal(p.detach(), params[name]), name


def test_presets_files_and_overrides_build_configs(tmp_path):
    llama = hf.load_config("llama-tiny", {"hidden_size": "32", "num_hidden_layers": "1"})
    assert (llama.model_type, llama.hidden_size, llama.num_hidden_layers, llama.vocab_size) == ("llama", 32, 1, 256)
    llama.save_pretrained(tmp_path / "cfg")
    again = hf.load_config(str(tmp_path / "cfg"))  # a directory holding config.json
    assert (again.model_type, again.hidden_size) == ("llama", 32)
    assert hf.load_config(str(tmp_path / "cfg" / "config.json")).num_hidden_layers == 1
    with pytest.raises(hf.HFTaskError, match="has no attribute 'hiden_size'"):
        hf.load_config("llama-tiny", {"hiden_size": "32"})
    with pytest.raises(hf.HFTaskError, match="neither a preset"):
        hf.load_config(str(tmp_path / "nothing"))
    with pytest.raises(hf.HFTaskError, match="vocab_size 100 is below the tokenizer's 256"):
        hf.load_config("gpt2-tiny", {"vocab_size": "100"})
    (tmp_path / "broken.json").write_text('{"model_type": "llama",')
    with pytest.raises(hf.HFTaskError, match="broken.json: not a JSON config"):
        hf.load_config(str(tmp_path / "broken.json"))
    (tmp_path / "alien.json").write_text('{"model_type": "no-such-model"}')
    with pytest.raises(hf.HFTaskError, match="'no-such-model' is not one transformers"):
        hf.load_config(str(tmp_path / "alien.json"))
    with pytest.raises(hf.HFTaskError, match="config.hidden_size=abc"):
        hf.load_config("llama-tiny", {"hidden_size": "abc"})


def test_a_model_that_sees_the_future_is_refused(tmp_path):
    (tmp_path / "bert.json").write_text('{"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 1, '
                                        '"num_attention_heads": 2, "intermediate_size": 64, "vocab_size": 256}')
    bert = hf.build_model(hf.load_config(str(tmp_path / "bert.json")), seed=0)  # an LM head, bidirectional
    with pytest.raises(hf.HFTaskError, match="is not causal"):
        hf.check_causal(bert, 256)
    llama = hf.build_model(hf.load_config("llama-tiny"), seed=0)
    hf.check_causal(llama, 256)
    assert llama.training  # its mode is left as it was


def test_a_missing_transformers_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(ModuleNotFoundError, match=r'pip install -e "\.\[hf\]"'):
        hf.load_config("llama-tiny")


def test_byte_tokenizer_and_corpus_files(tmp_path):
    tok = hf.ByteTokenizer()
    assert tok.decode(tok.encode("Ay, ‘tis so")) == "Ay, ‘tis so"
    ctx = context(tmp_path)
    (tmp_path / "corpus" / ".hidden").write_text("not text")
    files = hf.text_files(ctx.data_path)
    assert [f.name for f in files] == ["a.txt", "b.txt"]
    tokens = hf.load_tokens(files, tok)
    assert tok.decode(tokens) == files[0].read_text() + "\n" + files[1].read_text()
    assert len(hf.text_files(None)) > 10  # the bundled plays, one file per play
    with pytest.raises(hf.HFTaskError, match="does not exist"):
        hf.text_files(tmp_path / "missing")
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "train.py").write_text("print('a user corpus of code is text too')\n")
    assert [f.name for f in hf.text_files(tmp_path / "code")] == ["train.py"]
    (tmp_path / "noise").mkdir()
    (tmp_path / "noise" / "random.bin").write_bytes(bytes(range(128, 256)))
    with pytest.raises(hf.HFTaskError, match="random.bin: not UTF-8 text"):
        hf.load_tokens(hf.text_files(tmp_path / "noise"), tok)


@pytest.mark.parametrize("preset, layer", [("llama-tiny", "LlamaDecoderLayer"), ("gpt2-tiny", "GPT2Block")])
def test_save_pretrained_reads_back_bit_identical(tmp_path, preset, layer):
    config = hf.load_config(preset)
    model = hf.build_model(config, seed=5)
    with torch.no_grad():  # parameters no initialization would give
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    hf.save_pretrained(config, params, tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert_reads_back(tmp_path / "out", params)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    x = torch.randint(0, 256, (2, 16))
    assert torch.equal(model.eval()(input_ids=x).logits, back(input_ids=x).logits)
    units = hf.decoder_layers(model)
    assert [type(m).__name__ for n, m in model.named_modules() if units(n, m)] == [layer, layer]
    with pytest.raises(hf.HFTaskError, match="missing"):
        hf.save_pretrained(config, {n: p for n, p in list(params.items())[1:]}, tmp_path / "bad")


def test_the_task_is_resumable_data_and_checks_its_arguments(tmp_path):
    task = hf.causal_lm_task(context(tmp_path, config="gpt2-tiny", block="16"))
    assert isinstance(task.train_batches, EpochSampler) and is_data_source(task.train_batches)
    assert task.shard is None and task.export is None  # DDP unless --parallel fsdp
    x, y = next(task.train_batches)
    assert x.shape == (2, 16) and torch.equal(x[:, 1:], y[:, :-1])
    assert torch.isfinite(task.loss(task.model, (x, y)))
    cfg = Config()
    cfg.topology.parallel = "fsdp"
    sharded = hf.causal_lm_task(replace(context(tmp_path, block="16"), config=cfg))
    assert [n for n, m in sharded.model.named_modules() if sharded.shard(n, m)] == ["model.layers.0", "model.layers.1"]
    with pytest.raises(hf.HFTaskError, match="unknown --entry-args"):
        hf.causal_lm_task(context(tmp_path, blocks="16"))
    with pytest.raises(hf.HFTaskError, match="longer than the config's 8 positions"):
        hf.causal_lm_task(context(tmp_path, **{"config": "gpt2-tiny", "config.n_positions": "8", "block": "16"}))
    for bad in ("0", "abc", "1"):
        with pytest.raises(hf.HFTaskError, match=f"block={bad}: tokens per sequence must be an integer >= 2"):
            hf.causal_lm_task(context(tmp_path, block=bad))


def run_entry(tmp_path: Path, name: str, entry_args: str, *flags: str) -> dict:
    out = tmp_path / f"{name}.json"
    code = cli.main([*RUN, "--entry", "examples.hf_causal_lm:make_task", "--entry-args", entry_args, *flags,
                     "--json", str(out), "--run-dir", str(tmp_path / name)])
    assert code == 0, (tmp_path / name / "group-0.log").read_text()[-3000:]
    return json.loads(out.read_text())


def check_run(s: dict, out_dir: Path, saved: Path, rounds: int) -> None:
    """Groups bit-identical every round, each sample counted once, and the written model the global one."""
    assert s["outer_rounds"] == rounds and s["params_identical"]
    hashes = list(s["round_hashes_per_group"].values())
    assert len(hashes[0]) == rounds and all(h == hashes[0] for h in hashes)
    assert all(d["twice"] == 0 and d["left_out"] == 0 and d["committed"] > 0 for d in s["data_per_group"].values())
    assert s["exported"] == str(out_dir) and s["eval_loss"] < s["initial_eval_loss"]
    whole = checkpoint.load(saved)["global"]  # --save's copy of the final global parameters
    assert_reads_back(out_dir, whole)
    back = transformers.AutoModelForCausalLM.from_pretrained(out_dir)
    assert params_hash([p.detach() for p in back.parameters()]) == s["param_hash_per_group"]["0"]


@pytest.mark.slow
def test_entry_trains_a_llama_sharded_with_fsdp2_and_writes_it_with_save_pretrained(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # --entry modules import like `python -m`: from the current directory
    out_dir = tmp_path / "llama"
    s = run_entry(tmp_path, "fsdp", f"config=llama-tiny,block=32,save_pretrained={out_dir}", "--groups", "2",
                  "--ranks-per-group", "2", "--parallel", "fsdp", "--steps", "12", "--h", "4", "--inner-lr", "3e-3",
                  "--save", str(tmp_path / "final.pt"))
    check_run(s, out_dir, tmp_path / "final.pt", rounds=3)
    assert s["ranks_per_group"] == [2, 2] and s["config"]["topology"]["parallel"] == "fsdp"


@pytest.mark.slow
def test_entry_trains_a_tied_gpt2_with_ddp(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    out_dir = tmp_path / "gpt2"
    s = run_entry(tmp_path, "ddp", f"config=gpt2-tiny,block=32,save_pretrained={out_dir}", "--groups", "2",
                  "--ranks-per-group", "1", "--steps", "8", "--h", "4", "--inner-lr", "3e-3", "--codec", "int8",
                  "--save", str(tmp_path / "final.pt"))
    check_run(s, out_dir, tmp_path / "final.pt", rounds=2)


def test_a_save_pretrained_target_that_cannot_be_written_fails_before_training(tmp_path):
    (tmp_path / "file").write_text("")
    ctx = context(tmp_path, save_pretrained=str(tmp_path / "file" / "sub"))
    with pytest.raises(hf.HFTaskError, match="cannot create the directory"):
        hf.causal_lm_task(replace(ctx, group=0))
    with pytest.raises(hf.HFTaskError, match="exists and is not a directory"):
        hf.causal_lm_task(replace(context(tmp_path, save_pretrained=str(tmp_path / "file")), group=0))
    config = hf.load_config("llama-tiny")
    params = {n: p.detach() for n, p in hf.build_model(config, seed=0).named_parameters()}
    out = tmp_path / "made-then-replaced"
    out.write_text("a file where the directory was")  # after the early check: transformers would only log it
    with pytest.raises(hf.HFTaskError, match="exists and is not a directory"):
        hf.save_pretrained(config, params, out)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(hf.HFTaskError, match="wrote no config.json and \\*.safetensors"):
        hf.check_saved(empty)


@pytest.mark.slow
def test_the_python_api_example_runs_as_two_processes(tmp_path):
    out_dir = tmp_path / "api"
    results, _ = run_api_example(REPO / "examples" / "hf_train_api.py",
                                 ["--steps", "16", "--h", "8", "--block", "32", "--batch-size", "4",
                                  "--save-pretrained", str(out_dir)])
    assert results[0]["param_hash"] == results[1]["param_hash"] and results[0]["outer_rounds"] == 2
    back = transformers.AutoModelForCausalLM.from_pretrained(out_dir)
    assert params_hash([p.detach() for p in back.parameters()]) == results[0]["param_hash"]
