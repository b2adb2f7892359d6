import pytest

from genome_lm.config import CONFIG_DIR, RunConfig, load_config
from genome_lm.errors import GenomeLMError


@pytest.mark.parametrize("name", sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
def test_shipped_configs_validate(name):
    cfg = load_config(name)
    assert isinstance(cfg, RunConfig)
    assert cfg.train.global_batch_size % cfg.train.micro_batch_size == 0


def test_published_setups_are_shipped():
    c512, c1m = load_config("glm-5.3-flash-512k-64xb200"), load_config("glm-5.3-flash-1m-64xb200")
    assert (c512.data.seq_len, c1m.data.seq_len) == (524288, 1048576)
    for cfg in (c512, c1m):
        p = cfg.parallel
        assert (p.tp, p.ep, p.etp) == (8, 32, 2) and cfg.memory.recompute == "full"
        assert cfg.memory.offload_activations and cfg.memory.moe_chunks == 64
    assert (c512.parallel.cp, c1m.parallel.cp) == (1, 2)


def test_overrides_are_typed():
    cfg = load_config("demo-cpu", ["train.steps=3", "data.seq_len_warmup=[[0, 1024], [2, 4096]]"])
    assert cfg.train.steps == 3 and cfg.data.seq_len_warmup == [(0, 1024), (2, 4096)]
    assert load_config("demo-cpu").train.steps != 3  # overrides do not leak


@pytest.mark.parametrize("override,message", [
    ("train.stepz=5", "--set train.stepz: no such field; did you mean train.steps?"),
    ("memory.offload_activations=true,", "memory.offload_activations: Input should be a valid boolean"),
    ("train.lr=fast", "train.lr"),
    ("data.softmask_weight=2", "less than or equal to 1"),
    ("parallel.pp=0", "parallel.pp: Input should be greater than or equal to 1"),
    ("parallel.sequence_parallel=maybe", "parallel.sequence_parallel: Input should be a valid boolean"),
    ("nosection", "expected section.field=value"),
    ("memory.moe_chunk_recompute=true", "moe_chunk_recompute needs moe_chunks > 1"),
])
def test_bad_values_are_one_line_errors(override, message):
    with pytest.raises(GenomeLMError, match=message.replace(".", r"\.").replace("(", r"\(")) as info:
        load_config("demo-cpu", [override])
    assert "\n" not in str(info.value)



def test_moe_aux_loss_with_chunked_moe_is_an_error():
    """Each chunk would be balanced on its own, not the sequence: refused, in one line."""
    with pytest.raises(GenomeLMError, match="moe_aux_loss_coeff > 0 needs memory.moe_chunks = 1") as info:
        load_config("demo-cpu", ["train.moe_aux_loss_coeff=0.001", "memory.moe_chunks=4"])
    assert "\n" not in str(info.value) and "got" not in str(info.value)
    assert load_config("demo-cpu", ["train.moe_aux_loss_coeff=0", "memory.moe_chunks=4"]).memory.moe_chunks == 4

def test_bad_files(tmp_path):
    (tmp_path / "a.yaml").write_text("train: {steps: 3\n")
    with pytest.raises(GenomeLMError, match="a.yaml:2:1: not valid YAML: expected"):
        load_config(str(tmp_path / "a.yaml"))
    (tmp_path / "b.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(GenomeLMError, match="mapping of sections"):
        load_config(str(tmp_path / "b.yaml"))
    (tmp_path / "c.yaml").write_text("trian:\n  steps: 3\n")
    with pytest.raises(GenomeLMError, match="c.yaml: trian: no such section; did you mean train"):
        load_config(str(tmp_path / "c.yaml"))
    with pytest.raises(GenomeLMError, match="shipped: demo-cpu"):
        load_config("no-such-config")


def test_resolved_round_trips():
    cfg = load_config("glm-5.3-flash-1m-64xb200")
    assert RunConfig.model_validate(cfg.resolved(), strict=False) == cfg


def test_exponent_without_dot_is_a_number(tmp_path):
    (tmp_path / "lr.yaml").write_text("train:\n  lr: 1e-5\n  min_lr: 2E-6\n")
    cfg = load_config(str(tmp_path / "lr.yaml"), ["train.weight_decay=1e-2"])
    assert (cfg.train.lr, cfg.train.min_lr, cfg.train.weight_decay) == (1e-5, 2e-6, 1e-2)


def test_a_yaml_syntax_error_names_the_line_and_column(tmp_path):
    """file:line:column as editors count them (PyYAML's marks are 0-based), and the problem."""
    path = tmp_path / "my.yaml"
    path.write_text("train:\n  steps: 3\n  lr: 1e-5: 2\n")
    with pytest.raises(GenomeLMError) as info:
        load_config(str(path))
    assert str(info.value) == f"{path}:3:11: not valid YAML: mapping values are not allowed here"
    path.write_text("train: {steps: 3\n")  # the problem at the end, the brace left open on line 1
    with pytest.raises(GenomeLMError) as info:
        load_config(str(path))
    assert str(info.value) == (f"{path}:2:1: not valid YAML: expected ',' or '}}', but got '<stream end>' "
                               "(while parsing a flow mapping at 1:8)")


def test_a_set_value_that_is_not_yaml_is_one_line_naming_the_item():
    with pytest.raises(GenomeLMError) as info:
        load_config("demo-cpu", ["train.steps=3", "data.seq_len_warmup=[[0, 1024],"])
    assert str(info.value) == ("--set 'data.seq_len_warmup=[[0, 1024],': not valid YAML at column 12 of the value: "
                               "expected the node content, but found '<stream end>'")


@pytest.mark.parametrize("override,message", [
    ("train.stpes=3", "--set train.stpes: no such field; did you mean train.steps?"),
    ("model.chekpoint=x", "--set model.chekpoint: no such field; did you mean model.checkpoint?"),
    ("trian.steps=3", "--set trian: no such section; did you mean train?"),
    ("zzz.steps=3",
     "--set zzz: no such section; the sections are data, model, parallel, memory, train, tracking, peft"),
    ("data.mix=[{dataset: d, fraction: 0.2, splt: eval}]",
     "--set data.mix.0.splt: no such field; did you mean data.mix.0.split?"),
    ("data.mix=[{dataset: d, fractoin: 0.2}]",  # the typo, not the missing fraction it causes
     "--set data.mix.0.fractoin: no such field; did you mean data.mix.0.fraction?"),
    ("data.mix=[{dataset: d, fraction: 0.2, qqq: 1}]",
     "--set data.mix.0.qqq: no such field; the fields of data.mix are dataset, split, fraction"),
])
def test_an_unknown_key_is_named_with_the_closest_valid_ones(override, message):
    with pytest.raises(GenomeLMError) as info:
        load_config("demo-cpu", [override])
    assert str(info.value) == message


def test_an_unknown_key_in_a_file_is_the_files_fault(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: 3\n  warmup_stpes: 2\n")
    with pytest.raises(GenomeLMError) as info:
        load_config(str(path), ["train.steps=4"])
    assert str(info.value) == f"{path}: train.warmup_stpes: no such field; did you mean train.warmup_steps?"
    path.write_text("tracking:\n  zzz: 1\n")
    with pytest.raises(GenomeLMError) as info:
        load_config(str(path))
    assert str(info.value) == (f"{path}: tracking.zzz: no such field; the fields of tracking are uri, experiment, "
                               "run_name")
