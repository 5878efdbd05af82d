"""`--generation-config` / `--override-generation-config` (`serving.generation_defaults`):
which default sampling a server applies, read from files written here and from the tiny
checkpoint's own generation_config.json (temperature 1.0, top_p 0.95)."""

import json
import logging

import pytest

from glm53.tiny_checkpoint import default_model_dir
from serving.cli_args import ArgumentError, make_arg_parser, validate_args
from serving.generation_defaults import (
    GenerationConfigError,
    load_generation_defaults,
)


def write(dirpath, **cfg):
    (dirpath / "generation_config.json").write_text(json.dumps(cfg))
    return str(dirpath)


def test_auto_reads_the_checkpoint_and_vllm_ignores_it():
    ckpt = default_model_dir()
    with open(f"{ckpt}/generation_config.json") as f:
        raw = json.load(f)
    assert load_generation_defaults("auto", ckpt) == {"temperature": raw["temperature"], "top_p": raw["top_p"]}
    assert load_generation_defaults("vllm", ckpt) == {}
    assert load_generation_defaults("auto", None) == {}
    assert load_generation_defaults("vllm", ckpt, {"temperature": 0.3}) == {"temperature": 0.3}


def test_a_directory_its_keys_the_override_and_what_is_not_applied(tmp_path, caplog):
    d = write(tmp_path, temperature=0.7, top_k=20, min_p=0.05, max_new_tokens=64, repetition_penalty=1.1,
              do_sample=True, eos_token_id=[1, 2])
    with caplog.at_level(logging.WARNING, logger="serving.generation_defaults"):
        got = load_generation_defaults(d, "/nonexistent", {"temperature": 0.2, "top_p": 0.8})
    assert got == {"temperature": 0.2, "top_k": 20, "min_p": 0.05, "max_tokens": 64, "top_p": 0.8,
                   "repetition_penalty": 1.1}
    assert caplog.text == ""  # every key applied (do_sample and eos_token_id are not sampling defaults)


@pytest.mark.parametrize("cfg,words", [
    ({"top_p": 0}, "top_p must be in (0, 1]"),
    ({"temperature": -1}, "temperature must be a finite number >= 0"),
    ({"top_k": -3}, "top_k must be 0 or -1"),
    ({"min_p": 2}, "min_p must be in [0, 1]"),
    ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
    ({"repetition_penalty": 0}, "repetition_penalty must be a finite number > 0"),
    ({"temperature": "hot"}, "temperature must be a number"),
])
def test_bad_values_name_the_file_and_key(tmp_path, cfg, words):
    d = write(tmp_path, **cfg)
    with pytest.raises(GenerationConfigError, match=r"generation_config\.json") as e:
        load_generation_defaults(d, None)
    assert words in str(e.value)
    with pytest.raises(GenerationConfigError, match="--override-generation-config") as e:
        load_generation_defaults("vllm", None, cfg)
    assert words in str(e.value)


def test_flags_are_checked_at_start_up(tmp_path):
    def args(*argv):
        a = make_arg_parser().parse_args(list(argv))
        validate_args(a)
        return a

    assert args().generation_config == "auto"
    assert args("--override-generation-config", '{"top_k": 5}').override_generation_config == {"top_k": 5}
    with pytest.raises(ArgumentError, match="no generation_config.json there"):
        args("--generation-config", str(tmp_path))
    with pytest.raises(ArgumentError, match="unknown key 'seed'"):
        args("--override-generation-config", '{"seed": 1}')
    with pytest.raises(ArgumentError, match="not valid JSON"):
        args("--override-generation-config", "{temperature: 1}")
