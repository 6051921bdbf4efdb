"""Config: flags, YAML, precedence, validation messages that name the flag, generated docs."""

import pytest
import yaml

from relax.cli.args import build_parser, parse_config, render_config_reference
from relax.config import ConfigError, RelaxConfig
from tests.support.runs import ROOT

GOOD = ["--n-samples-per-prompt", "4", "--num-rollout", "3"]


def test_flags_use_upstream_names_and_types():
    cfg = parse_config(GOOD + [
        "--rollout-batch-size", "2", "--eps-clip-high", "0.28", "--use-kl-loss", "--kl-loss-coef", "0.01",
        "--kl-loss-type", "low_var_kl", "--rollout-stop", "\n\n", "END", "--rollout-stop-token-ids", "7",
        "--eval-prompt-data", "math", "test.jsonl", "--apply-chat-template-kwargs", '{"enable_thinking": false}',
        "--calculate-per-token-loss", "--no-use-tensorboard",
    ])
    assert cfg.rollout_batch_size == 2 and cfg.eps_clip_high == 0.28 and cfg.use_kl_loss
    assert cfg.kl_loss_type == "low_var_kl" and cfg.rollout_stop == ["\n\n", "END"]
    assert cfg.rollout_stop_token_ids == [7] and cfg.eval_prompt_data == {"math": "test.jsonl"}
    assert cfg.apply_chat_template_kwargs == {"enable_thinking": False}
    assert cfg.calculate_per_token_loss and not cfg.use_tensorboard
    assert cfg.train_batch_size == 8 and cfg.steps_per_rollout == 1


def test_yaml_then_flags(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("rollout-batch-size: 4\nn_samples_per_prompt: 4\nlr: 1.0e-5\nnum_rollout: 2\n"
                      "eval_prompt_data: {held_out: t.jsonl}\n")
    cfg = parse_config(["--config", str(config), "--lr", "3e-5"])
    assert cfg.rollout_batch_size == 4 and cfg.lr == 3e-5 and cfg.eval_prompt_data == {"held_out": "t.jsonl"}


def test_unknown_yaml_key_suggests_the_right_one(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("rollout_batch_sise: 4\n")
    with pytest.raises(ConfigError, match="unknown setting 'rollout_batch_sise'; did you mean 'rollout_batch_size'"):
        parse_config(["--config", str(config)])


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--global-batch-size", "3", "--rollout-batch-size", "2"], "--global-batch-size \\(3\\) must divide"),
        (["--micro-batch-size", "3", "--rollout-batch-size", "2"], "--micro-batch-size \\(3\\) must divide"),
        (["--kl-loss-coef", "0.1"], "--kl-loss-coef > 0 has no effect without --use-kl-loss"),
        (["--eps-clip", "1.5"], "--eps-clip: Input should be less than 1"),
        (["--rollout-top-k", "0"], "--rollout-top-k must be -1"),
        (["--eval-interval", "2"], "--eval-interval needs --eval-prompt-data"),
        (["--advantage-estimator", "bogus"], "--advantage-estimator: unknown estimator 'bogus'"),
        (["--rollout-temperature", "0"], "--rollout-temperature: Input should be greater than 0"),
        (["--system-prompt", "be brief"], "--system-prompt needs --apply-chat-template"),
        (["--genrm-sampling-config", '{"temperature": 0.5}', "--genrm-prompt-template", "{prompt}"],
         "--genrm-prompt-template, --genrm-sampling-config: settings of the judge model of --genrm-model-path, "
         "which is not set"),
        (["--custom-rm-workers", "2"], "--custom-rm-workers: the processes that run --custom-rm-path's function"),
        (["--max-total-tokens", "64", "--page-size", "65"], "--max-total-tokens 64 is less than one page of "
                                                              "--page-size 65"),
    ],
)
def test_invalid_settings_name_the_flag(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(GOOD + flags)


def test_grpo_with_one_sample_per_prompt_is_rejected():
    with pytest.raises(ConfigError, match="needs --n-samples-per-prompt >= 2"):
        parse_config(["--num-rollout", "1", "--n-samples-per-prompt", "1"])


def test_num_rollout_and_num_epoch():
    cfg = parse_config(GOOD + ["--num-epoch", "1", "--rollout-batch-size", "4"])
    assert cfg.total_rollout_steps(num_prompts=8) == 2  # one epoch of 8 prompts is 2 steps; num_rollout 3
    cfg = RelaxConfig(n_samples_per_prompt=2)
    with pytest.raises(ConfigError, match="--num-rollout or --num-epoch"):
        cfg.total_rollout_steps(10)


def test_every_field_has_help_and_a_flag():
    help_text = build_parser().format_help()
    for name, info in RelaxConfig.model_fields.items():
        assert info.description, name
        assert "--" + name.replace("_", "-") in help_text


def test_docs_config_md_is_generated_from_the_fields():
    committed = (ROOT / "docs" / "config.md").read_text()
    assert committed.strip() == render_config_reference().strip(), "run: relax config-docs > docs/config.md"


def test_lengths_beyond_the_models_positions_are_refused_before_anything_loads(tiny_workspace, tmp_path, capsys):
    from relax.cli.main import main
    from tests.support.runs import tiny_train_args

    args = tiny_train_args(tiny_workspace, tmp_path / "run", "--num-rollout", "1")
    args[args.index("--rollout-max-response-len") + 1] = "300"  # the tiny model has 256 positions
    assert main(["train", *args]) == 2
    assert "--rollout-max-response-len 300: the model at" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def _float_fields() -> list[str]:
    """Every setting whose value is (or may be) a float, found from the annotations rather than listed."""
    import typing

    names = []
    for name, field in RelaxConfig.model_fields.items():
        annotation = field.annotation
        kinds = typing.get_args(annotation) if typing.get_args(annotation) else (annotation,)
        if float in kinds:
            names.append(name)
    return names


def _path_fields() -> dict[str, type]:
    """The settings marked as files or folders, with the kind of value each holds (str, list or dict)."""
    import typing

    fields = {}
    for name, field in RelaxConfig.model_fields.items():
        if field.json_schema_extra.get("path"):
            kinds = [kind for kind in typing.get_args(field.annotation) or (field.annotation,) if kind is not type(None)]
            fields[name] = typing.get_origin(kinds[0]) or kinds[0]
    return fields


@pytest.mark.parametrize("blank", ["", " ", "\t"])
def test_no_file_or_folder_setting_takes_a_blank_path(blank, tmp_path):
    """`--output-dir ""` (an unset shell variable) wrote the run into the working directory, `--output-dir " "` into
    a folder named by a space: every file or folder setting refuses a blank path, a blank entry of a list or mapping
    of paths too, from the command line and from a --config file, naming its flag."""
    fields = _path_fields()
    named_as_paths = {name for name in RelaxConfig.model_fields
                      if name.endswith(("_dir", "checkpoint", "_model_path")) or name in ("save", "load")}
    assert named_as_paths <= set(fields), named_as_paths - set(fields)  # a new path setting is marked path=True
    assert {"hf_checkpoint", "prompt_data", "rm_path", "eval_prompt_data", "output_dir"} <= set(fields)
    for name, kind in fields.items():
        flag_name = "--" + name.replace("_", "-")
        value = {list: [blank], dict: {"held_out": blank}}.get(kind, blank)
        config_file = tmp_path / f"{name}.yaml"
        config_file.write_text(yaml.safe_dump({name: value}))
        with pytest.raises(ConfigError, match=f"{flag_name}: an empty path"):
            parse_config(["--config", str(config_file)])
        argv = {list: [flag_name, "x", blank], dict: [flag_name, "held_out", blank]}.get(kind, [f"{flag_name}={blank}"])
        with pytest.raises(ConfigError, match=f"{flag_name}: an empty path"):
            parse_config(argv)


YAML_SPELLING = {"inf": ".inf", "-inf": "-.inf", "nan": ".nan"}


@pytest.mark.parametrize("value", list(YAML_SPELLING))
def test_no_float_setting_takes_an_infinity_or_a_nan(value, tmp_path):
    """`--lr inf` trained (every weight NaN after the first step); no setting gives a meaning to a non-finite value,
    so every float setting refuses one, from the command line and from a --config file alike, naming its flag."""
    names = _float_fields()
    assert {"lr", "eps_clip", "kl_coef", "rollout_temperature"} <= set(names)
    for name in names:
        flag_name = "--" + name.replace("_", "-")
        with pytest.raises(ConfigError, match=f"{flag_name}: Input should be a finite number"):
            parse_config([f"{flag_name}={value}"])
        config_file = tmp_path / f"{name}.yaml"
        config_file.write_text(f"{name}: {YAML_SPELLING[value]}\n")
        with pytest.raises(ConfigError, match=f"{flag_name}: Input should be a finite number"):
            parse_config(["--config", str(config_file)])
