import pytest

from sonata.config import Config, apply_overrides, make_config
from sonata.errors import ConfigError


def test_defaults_are_the_seed_configuration():
    cfg = make_config()
    assert (cfg.model.d_model, cfg.model.n_layers, cfg.model.d_state, cfg.model.expand) == (96, 2, 16, 2)
    assert cfg.data.seq_len == 128 and cfg.data.vocab_size == 512
    assert cfg.model.dt_rank_ == 6 and cfg.model.d_inner == 192


def test_overrides_are_parsed_by_field_type():
    cfg = make_config(["model.d_model=64", "train.lr=1e-3", "data.source=/tmp/x.txt",
                       "train.micro_batch=4", "train.effective_batch=8"])
    assert cfg.model.d_model == 64 and isinstance(cfg.model.d_model, int)
    assert cfg.train.lr == 1e-3 and cfg.data.source == "/tmp/x.txt"
    assert cfg.train.accumulation == 2


@pytest.mark.parametrize("override,fragment", [
    ("model.d_modle=64", "unknown config key 'model.d_modle'"),
    ("modle.d_model=64", "unknown config section 'modle'"),
    ("model.d_model=abc", "not an integer"),
    ("train.lr=fast", "not a number"),
    ("model.d_model=0", "model.d_model must be positive"),
    ("model.backend=gpu", "model.backend must be"),
    ("train.micro_batch=-1", "train.micro_batch must be >= 0"),
    ("train.precision=fp8", "train.precision must be auto or one of"),
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
