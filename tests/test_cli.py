"""`fastmae`'s own help says what each subcommand does today, with no internal names; `--version`; no arguments
prints the help and succeeds; `train --help` lists every config key, and the docs' commands use only flags and keys
that exist."""

import re
import subprocess

import pytest
import warm_python

from fastmae import __version__
from fastmae.cli import SUBCOMMANDS, main


def test_no_arguments_help_and_version(capsys):
    assert main([]) == 0
    said = capsys.readouterr().out
    assert said.startswith("usage: fastmae") and all(f"  {name} " in said for name in SUBCOMMANDS)
    assert main(["--help"]) == 0 and capsys.readouterr().out == said
    assert main(["--version"]) == 0 and capsys.readouterr().out == f"fastmae {__version__}\n"
    assert main(["exprot"]) == 2 and "unknown subcommand 'exprot'" in capsys.readouterr().err
    export_line = next(line for line in said.splitlines() if line.startswith("  export "))
    assert all(name in export_line for name in ("RoBERTa", "RoFormer", "ESM-2", "ModernBERT", "BERT's as a BERT",
                                                "model card", "hf extra"))
    lines = {line.split()[0]: line for line in said.splitlines() if line.startswith("  ")}
    assert "Hugging Face tokenizer" in lines["prepare"] and "neighbour probe" in lines["analyze"]  # what they do today


def test_the_commands_that_take_a_model_say_which_esm_they_read(capsys):
    with pytest.raises(SystemExit):
        main(["analyze", "--help"])
    said = " ".join(capsys.readouterr().out.split())
    assert "neighbour probe" in said and "token_dropout off" in said and "released ESM-2 checkpoints" in said


def test_the_console_script_with_no_arguments_exits_zero():
    done = subprocess.run([*warm_python.COMMAND, "-m", "fastmae.cli"], capture_output=True, text=True, timeout=60,
                          env=warm_python.environment())
    assert done.returncode == 0 and done.stdout.startswith("usage: fastmae"), done.stderr


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_subcommand_help_names_no_internals(name, capsys):
    with pytest.raises(SystemExit) as done:
        main([name, "--help"])
    assert done.value.code == 0
    said = capsys.readouterr().out
    assert said.startswith(f"usage: fastmae {name}")
    # a dotted module path or a backticked function name means nothing to someone reading --help
    assert not re.search(r"fastmae\.[a-z_]+\.|`[a-z]+_[a-z_]+`", said), said


def test_export_help_says_what_it_needs_writes_and_refuses(capsys):
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    said = " ".join(capsys.readouterr().out.split())
    for fact in ("RoBERTa", "RoFormer", "ESM-2", "ModernBERT", "comes back as a BERT", "without an MLM head",
                 "pip install 'fastmae[hf]'", "model card", "relative position bias",
                 "0 < insert_layer < encoder_layers", "rotary_base other than 10000"):
        assert fact in said, fact


def test_train_help_lists_every_config_key_by_section(capsys):
    import dataclasses

    from fastmae.config import SECTIONS, ModelConfig

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    said = " ".join(capsys.readouterr().out.split())
    assert "Pretrain a masked LM (mlm, mae-lm or 3ml)" in said
    for name, section in {"model": ModelConfig, **SECTIONS}.items():
        listed = said.split(f" {name}: ", 1)[1].split(": ", 1)[0]
        expected = {f.name for f in dataclasses.fields(section) if f.init} - {"objective"}
        assert expected <= {key.strip(", ") for key in listed.split()}, name


def test_the_docs_commands_use_flags_and_keys_that_exist():
    """Every `fastmae SUBCOMMAND ... --flag` and every `section.key=value` README.md and docs/ write names an option or
    a config key the code has: a doc that drifts from the code fails here."""
    import dataclasses
    import importlib
    from pathlib import Path

    from fastmae.config import SECTIONS, ModelConfig

    root = Path(__file__).resolve().parent.parent
    flags = {name: {option for action in importlib.import_module(module).build_parser()._actions
                    for option in action.option_strings} for name, (module, _) in SUBCOMMANDS.items()}
    keys = {"model.preset"} | {f"{name}.{f.name}" for name, section in {"model": ModelConfig, **SECTIONS}.items()
                               for f in dataclasses.fields(section) if f.init}
    stale = []
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        text = doc.read_text().replace("\\\n", " ")
        for command in re.finditer(r"fastmae (\w+) ([^\n`]*)", text):
            if command.group(1) in flags:
                stale += [(doc.name, command.group(1), flag) for flag in re.findall(r"(?<![\w-])--[a-z][a-z-]*",
                                                                                      command.group(2))
                          if flag not in flags[command.group(1)]]
        stale += [(doc.name, key) for key in re.findall(r"\b(?:model|data|train|eval|checkpoint|log)\.\w+(?==)", text)
                  if key not in keys]
    assert not stale, stale
