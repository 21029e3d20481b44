import pytest

from sonata.core.config import Config, apply_overrides, describe_length, make_config, with_train_defaults
from sonata.core.errors import ConfigError


def test_defaults_are_the_seed_configuration():
    cfg = make_config()
    assert (cfg.model.d_model, cfg.model.n_layers, cfg.model.d_state, cfg.model.expand) == (96, 2, 16, 2)
    assert cfg.data.seq_len == 128 and cfg.data.vocab_size == 512
    assert cfg.model.effective_dt_rank == 6 and cfg.model.d_inner == 192


UNSET = {"data.vocab_size": 0, "train.lr": 0.0, "train.max_steps": 0, "train.max_seconds": 0.0}


@pytest.mark.parametrize("source, vocab, lr, steps, seconds, line", [
    ("embedded", 512, 3e-3, 1500, 0.0, "vocabulary 512, peak lr 0.003, 1,500 steps"),
    ("tinystories", 2048, 6e-3, 0, 600.0, "vocabulary 2,048, peak lr 0.006, a 600 s time budget"),
    ("/data/stories.txt", 2048, 6e-3, 0, 600.0, "vocabulary 2,048, peak lr 0.006, a 600 s time budget"),
])
def test_train_defaults_follow_the_data(source, vocab, lr, steps, seconds, line):
    """make train / notebook 01: values left at 0 (or absent) take the defaults of the data."""
    for given in ({"data.source": source, **UNSET}, {"data.source": source}):
        cfg = make_config(with_train_defaults(given))
        assert (cfg.data.vocab_size, cfg.train.lr, cfg.train.max_steps, cfg.train.max_seconds) == \
            (vocab, lr, steps, seconds)
        assert describe_length(cfg) == line
        real = vocab == 2048                 # the race's winner on real text; the seed configuration embedded
        assert (cfg.data.seq_len, cfg.train.effective_batch, cfg.train.weight_decay, cfg.train.precision) == \
            ((512, 4, 0.3, "fast") if real else (128, 16, 0.1, "auto"))


def test_train_defaults_never_replace_a_value_that_is_set():
    real = {"data.source": "tinystories", **UNSET}
    cfg = make_config(with_train_defaults({**real, "data.vocab_size": 1024, "train.lr": 1e-3}))
    assert (cfg.data.vocab_size, cfg.train.lr, cfg.train.max_seconds) == (1024, 1e-3, 600.0)
    cfg = make_config(with_train_defaults({**real, "data.seq_len": 128, "train.effective_batch": 16,
                                           "train.precision": "fp32"}))
    assert (cfg.data.seq_len, cfg.train.effective_batch, cfg.train.precision) == (128, 16, "fp32")
    # a length set either way replaces the data's whole default length
    cfg = make_config(with_train_defaults({**real, "train.max_steps": 300}))
    assert (cfg.train.max_steps, cfg.train.max_seconds) == (300, 0.0)
    assert describe_length(cfg) == "vocabulary 2,048, peak lr 0.006, 300 steps"
    cfg = make_config(with_train_defaults({"data.source": "embedded", **UNSET, "train.max_seconds": 30.0}))
    assert (cfg.train.max_steps, cfg.train.max_seconds, cfg.data.vocab_size) == (0, 30.0, 512)
    cfg = make_config(with_train_defaults({**real, "train.max_seconds": 30.0, "train.max_steps": 50}))
    assert describe_length(cfg) == "vocabulary 2,048, peak lr 0.006, a 30 s time budget, at most 50 steps"
    # the command line and the seed configuration are untouched by them
    assert make_config(["data.source=tinystories"]).data.vocab_size == 512


def test_overrides_are_parsed_by_field_type():
    cfg = make_config(["model.d_model=64", "train.lr=1e-3", "data.source=/tmp/x.txt",
                       "train.micro_batch=4", "train.effective_batch=8"])
    assert cfg.model.d_model == 64 and isinstance(cfg.model.d_model, int)
    assert cfg.train.lr == 1e-3 and cfg.data.source == "/tmp/x.txt"
    assert (cfg.train.micro_batch, cfg.train.effective_batch) == (4, 8)


@pytest.mark.parametrize("override,fragment", [
    ("model.d_modle=64", "unknown config key 'model.d_modle'"),
    ("modle.d_model=64", "unknown config section 'modle'"),
    ("model.d_model=abc", "not an integer"),
    ("train.lr=fast", "not a number"),
    ("model.d_model=0", "model.d_model must be positive"),
    ("model.backend=gpu", "model.backend must be"),
    ("train.micro_batch=-1", "train.micro_batch must be >= 0"),
    ("train.precision=fp8", "train.precision must be auto, fast or one of"),
    ("d_model=3", "section.name"),
    ("model.d_model", "key=value"),
])
def test_bad_overrides_name_the_problem(override, fragment):
    with pytest.raises(ConfigError, match=None) as e:
        apply_overrides(Config(), [override])
    assert fragment in str(e.value)


def test_effective_batch_must_be_a_multiple_of_the_micro_batch():
    with pytest.raises(ConfigError, match="multiple of train.micro_batch"):
        make_config(["train.effective_batch=16", "train.micro_batch=3"])
    with pytest.raises(ConfigError, match="not both"):
        make_config(["train.fixed_micro_batch=8", "train.micro_batch=4"])


def test_round_trip_through_dict():
    cfg = make_config(["model.d_model=48", "train.seed=7"])
    again = Config.from_dict(cfg.to_dict())
    assert again == cfg
    d = cfg.to_dict()
    d["train"]["bogus"] = 1
    with pytest.raises(ConfigError, match="train.bogus"):
        Config.from_dict(d)


@pytest.mark.parametrize("arch", ["attention", "gpt2"])
def test_a_constraint_is_refused_up_front_for_a_model_without_A(arch):
    """Issue 42 item 7: before, `model.a_constraint=true` with attention or gpt2 passed the
    check and crashed with a traceback after the first optimizer step."""
    from sonata.model import families                     # the family table checks what needs an A
    with pytest.raises(ConfigError, match=f"model.arch={arch} has no A to constrain"):
        families.validate(make_config([f"model.arch={arch}", "model.a_constraint=true"]))
    for ssm in ("mamba", "lti", "mamba2", "mamba3"):
        assert families.validate(make_config([f"model.arch={ssm}", "model.a_constraint=true"])).model.a_constraint


def test_a_constraint_with_attention_is_one_error_line_on_the_command_line(tmp_path):
    from conftest import _assert_one_error_line, run_cli
    r = run_cli("train", "--out", str(tmp_path / "run"), "model.arch=attention", "model.a_constraint=true",
                "train.max_steps=2")
    _assert_one_error_line(r, "has no A to constrain")


@pytest.mark.parametrize("override", ["model.dt_max=inf", "train.weight_decay=inf", "model.a_min=inf",
                                      "model.dt_init_floor=inf", "model.norm_eps=inf", "train.grad_clip=inf",
                                      "model.dt_max=nan"])
def test_infinite_and_nan_values_are_refused(override):
    """Issue 42 item 10: inf passed every range check (dt_max, weight_decay, a_min, ...) and
    made a NaN model: a ConfigError naming the key now."""
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=f"{key} must be a finite number, not (inf|nan)"):
        make_config([override])
    with pytest.raises(ConfigError):
        Config.from_dict({key.split(".")[0]: {key.split(".")[1]: float("inf")}})


def test_an_infinite_value_is_one_error_line_and_no_folder(tmp_path):
    from conftest import _assert_one_error_line, run_cli
    out = tmp_path / "run"
    r = run_cli("train", "--out", str(out), "model.dt_max=inf", "train.max_steps=2")
    _assert_one_error_line(r, "model.dt_max must be a finite number, not inf")
    assert not out.exists()
