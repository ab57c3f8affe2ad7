"""The node config of `backfill serve --config node.toml`: every malformed case fails with NodeConfigError."""

from __future__ import annotations

import pytest

from backfill.cli import main as cli_main
from backfill.errors import NodeConfigError
from backfill.node.config import ModelEntry, NodeSettings, is_node_config, load_node_config, node_config_from_dict

GOOD = """
[node]
metrics_port = 9100
num_handles = 16

[[models]]
name = "chat"
model = "tiny"
port = 8001

[[models]]
name = "code"
model = "tiny"
port = 8002
policy = "priority"
"""


def write(tmp_path, text: str):
    path = tmp_path / "node.toml"
    path.write_text(text)
    return path


def test_good_config_parses(tmp_path):
    config = load_node_config(write(tmp_path, GOOD))
    assert [m.name for m in config.models] == ["chat", "code"]
    assert config.node.num_blocks == 16 * 4
    assert config.model("code").policy == "priority" and config.model("chat").policy == "coserve"
    assert is_node_config(write(tmp_path, GOOD))


def models(*tables: str) -> str:
    return "".join(f"[[models]]\n{t}\n" for t in tables)


ONE = 'name = "a"\nmodel = "tiny"\nport = 8001'


@pytest.mark.parametrize("text, message", [
    ("[node]\nmetrics_prot = 1\n" + models(ONE), "unknown key 'metrics_prot'"),
    (models(ONE + "\nthreds = 2"), r"models\[a\]: unknown key 'threds'"),
    ("[nodes]\n" + models(ONE), "unknown top-level key 'nodes'"),
    ("[node]\nnum_handles = \"many\"\n" + models(ONE), r"\[node\].num_handles must be a int"),
    (models(ONE + "\nthreads = 1.5"), r"models\[a\].threads must be a int"),
    (models(ONE + "\nmax_model_len = true"), r"max_model_len must be a int"),
    ("[node]\nnum_handles = 0\n" + models(ONE), "num_handles must be an integer >= 1"),
    ("[node]\ngate = \"never\"\n" + models(ONE), "gate must be one of lifecycle, timeslice"),
    ("[node]\nwindow_s = -1\n" + models(ONE), "window_s must be a positive number"),
    (models(ONE + "\npolicy = \"cfs\""), "policy must be one of coserve, priority, fcfs, online-only"),
    (models('name = "a"\nmodel = "tiny"\nport = 70000'), r"port must be an integer in \[1, 65535\]"),
    (models('model = "tiny"\nport = 8001'), "needs a non-empty name"),
    (models(ONE, 'name = "a"\nmodel = "tiny"\nport = 8002'), "model name 'a' appears twice"),
    (models(ONE, 'name = "b"\nmodel = "tiny"\nport = 8001'), r"models\[b\].port 8001 is already used by models\[a\]"),
    ("[node]\nmetrics_port = 8001\n" + models(ONE), "already used by node.metrics_port"),
    (models('name = "a"\nmodel = "/no/such/model.gguf"\nport = 8001'), "no model file or directory at '/no/such"),
    ("[node]\nnum_handles = 4\n", r"at least one \[\[models\]\]"),
    ("models = 3\n", "models must be an array of tables"),
    ("[node]\nnum_handles = \n", "not valid TOML"),
    ("[node]\ndevice = \"tpu\"\n" + models(ONE), "node.device must be cpu, cuda or cuda:N"),
    ("[node]\ndevice = \"cuda:x\"\n" + models(ONE), "node.device must be cpu, cuda or cuda:N"),
])
def test_malformed_config_fails_with_a_typed_error(tmp_path, text, message):
    with pytest.raises(NodeConfigError, match=message):
        load_node_config(write(tmp_path, text))


def test_missing_file_and_direct_construction(tmp_path):
    with pytest.raises(NodeConfigError, match="cannot read node config"):
        load_node_config(tmp_path / "absent.toml")
    with pytest.raises(NodeConfigError, match="blocks_per_handle"):
        NodeSettings(blocks_per_handle=0)
    with pytest.raises(NodeConfigError, match="threads"):
        ModelEntry(name="a", port=1, model="tiny", threads=0)
    with pytest.raises(NodeConfigError, match="must be a table"):
        node_config_from_dict({"node": 3, "models": []})


def test_serve_refuses_a_malformed_node_config_at_start(tmp_path, capsys):
    path = write(tmp_path, models(ONE, 'name = "a"\nmodel = "tiny"\nport = 8002'))
    assert cli_main(["serve", "--config", str(path)]) == 2
    assert "model name 'a' appears twice" in capsys.readouterr().err


def test_the_node_runs_on_the_device_its_config_or_command_line_names(tmp_path):
    from backfill.node.config import on_device

    config = load_node_config(write(tmp_path, GOOD))
    assert config.node.device == "cpu"                          # the default: the CPU figures' setting
    on_gpu = load_node_config(write(tmp_path, "[node]\ndevice = \"cuda\"\n" + models(ONE)))
    assert on_gpu.node.device == "cuda"
    assert on_device(config, "cuda:1").node.device == "cuda:1"   # serve --config node.toml --device cuda:1
    assert on_device(on_gpu, "auto").node.device == "cuda" and on_device(on_gpu, None) is on_gpu
    with pytest.raises(NodeConfigError, match="node.device"):
        on_device(config, "gpu")


def test_a_model_entry_produces_its_serving_config_with_the_command_defaults():
    from backfill.serving.config import COMMAND_DEFAULTS

    node = NodeSettings(block_size=8)
    entry = ModelEntry(name="a", port=1, model="tiny", decode_attention="auto", max_model_len=256, threads=2)
    serving = entry.serving_config(node)
    assert serving.decode_attention == "auto" and serving.prompt_attention == "sdpa"   # each from its own key
    assert ModelEntry(name="a", port=1, model="tiny", prompt_attention="auto").serving_config(node).prompt_attention == "auto"
    assert (serving.dtype, serving.compile_decode) == (COMMAND_DEFAULTS["dtype"], COMMAND_DEFAULTS["compile_decode"])
    assert (serving.block_size, serving.max_model_len, serving.threads, serving.device) == (8, 256, 2, "cpu")
    on_gpu = entry.serving_config(NodeSettings(device="cuda"))
    assert not on_gpu.compile_decode and not on_gpu.cuda_graphs and on_gpu.cuda_kernels == "torch"
