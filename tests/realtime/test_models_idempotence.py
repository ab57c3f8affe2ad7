import json

import pytest
import torch

from backfill.errors import RealtimeError
from backfill.realtime.idempotence import IdempotenceMap, analyze, format_table
from backfill.realtime.models import _Builder, build_model

SHAPES = ("resnet152", "vgg19", "bert", "gpt2")


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def test_models_are_op_sequences_with_deterministic_outputs(tiny_models):
    for name in SHAPES:
        m = tiny_models[name].model
        assert len(m) > 20 and m.ops[0].inputs == ("input",)
        out = m.infer(m.example_input)
        assert torch.isfinite(out).all()
        assert _bits(out) == _bits(m.infer(m.example_input))
        # The same network built again (another process would) computes the same bits.
        again = build_model(name, tiny_models[name].model.info.get("scale", 0.125) if name in ("resnet152", "vgg19")
                            else 0.0625)
        assert _bits(again.infer(again.example_input)) == _bits(out)


def test_bad_input_and_unknown_model_are_typed_errors(tiny_models):
    m = tiny_models["vgg19"].model
    with pytest.raises(RealtimeError, match="input must be"):
        m.workspace().set_input(torch.zeros(1, 3, 8, 8))
    with pytest.raises(RealtimeError, match="unknown model"):
        build_model("yolo")
    with pytest.raises(RealtimeError, match="workspace block"):
        m.workspace(bytearray(16))


def test_table_finds_in_place_ops_and_small_groups(tiny_models):
    maps = {n: tiny_models[n].imap for n in SHAPES}
    r = maps["resnet152"].summary()
    # torchvision's Bottleneck: in-place ReLU (group: the bn before it) and `out += identity`
    # (group: bn3, add_); the ReLU after the add needs bn3, add_, relu_.
    assert r["non_idempotent_ops"] == {"relu_": r["non_idempotent_ops"]["relu_"], "add_": 6}
    assert set(r["group_sizes"]) == {2, 3} and r["max_group"] == 3
    assert 0.5 < r["idempotent_share"] < 0.7
    assert maps["vgg19"].summary()["non_idempotent_ops"] == {"relu_": 18}
    g = maps["gpt2"].summary()
    assert g["non_idempotent_ops"] == {"add_pos_": 1, "scale_": 2, "mask_": 2}
    assert g["group_sizes"] == {2: 3, 3: 2}  # mask_ needs scores, scale_, mask_
    for name in SHAPES:
        m, imap = tiny_models[name].model, maps[name]
        for i, op in enumerate(m.ops):
            assert imap.idempotent[i] == (not op.inplace)  # out-of-place ops write a buffer they never read
            assert imap.entry(i) <= i and (imap.idempotent[i] == (imap.entry(i) == i))
    table = format_table(list(maps.values()))
    assert table.count("\n") == 5 and "resnet152" in table


def test_paper_figure_9_example():
    """Fig. 9: K3 reads C, E and writes E; its minimal group is (K1, K2, K3)."""
    mem = {k: torch.zeros(4) for k in "ABCDEF"}
    b = _Builder("fig9", torch.zeros(4))
    b.values.update(mem)
    b.inplace("K0", lambda a, bb: a.copy_(bb + 1), "C", "A")            # reads A, B... writes C
    b.inplace("K1", lambda e, c, d: e.copy_(c * d), "E", "C", "D")       # reads C, D, writes E
    b.inplace("K2", lambda f, e: f.copy_(e + 2), "F", "E")               # reads E, writes F
    b.inplace("K3", lambda e, c: e.add_(c), "E", "C")                    # reads C, E, writes E
    for name in "ABCDEF":
        b.buffers[name] = type(b.buffers["input"])(name, (4,), torch.float32)
    model = b.finish("E")
    imap = analyze(model)
    assert imap.idempotent == (True, True, True, False)
    assert imap.entry(3) == 1


def test_strided_in_place_residual_groups_reach_its_first_writer():
    """A residual stream updated in place, part of it through a strided view (byte runs, not one
    range): each in-place update's group reaches back to the op that wrote the stream out of place."""
    b = _Builder("residual", torch.randn(4, 4))
    b.values.update(H=torch.zeros(4, 4), X=torch.zeros(4, 2))
    b.inplace("K0", lambda h, i: h.copy_(i + 1), "H", "input")           # writes H
    b.inplace("K1", lambda x, h: x.copy_(h[:, :2] * 2), "X", "H")        # reads H's left half
    b.inplace("K2", lambda h, x: h[:, :2].add_(x), "H", "X")             # left half in place
    b.inplace("K3", lambda x, h: x.copy_(h[:, 2:]), "X", "H")            # reads H's right half
    b.inplace("K4", lambda h, x: h[:, 2:].add_(x), "H", "X")             # right half in place
    for name, shape in (("H", (4, 4)), ("X", (4, 2))):
        b.buffers[name] = type(b.buffers["input"])(name, shape, torch.float32)
    imap = analyze(b.finish("H"))
    assert imap.idempotent == (True, True, False, True, False)
    # K2 needs K0 (K1 reads H but does not write it); K4 touches only the right half, which K2 left
    # alone, so its group is K3, K4 plus what wrote that half out of place: back to K0 as well.
    assert imap.group_entry == (0, 1, 0, 3, 0)


def test_table_elides_one_group_size_per_layer():
    n = 40
    idem = tuple(i % 5 != 4 for i in range(n))
    imap = IdempotenceMap("llm-like", tuple(f"op{i}" for i in range(n)), idem, tuple(i if idem[i] else 0 for i in range(n)))
    row = format_table([imap]).splitlines()[-1]
    assert "5: 1, 10: 1, ... (8 sizes), 40: 1" in row and row.endswith("| 40 |")


def test_metadata_roundtrip_and_errors(tmp_path, tiny_models):
    served = tiny_models["bert"]
    path = tmp_path / "bert.json"
    served.imap.save(path)
    assert IdempotenceMap.load(path, served.model) == served.imap
    with pytest.raises(RealtimeError, match="another model"):
        IdempotenceMap.load(path, tiny_models["gpt2"].model)
    bad = served.imap.to_json()
    bad["group_entry"][3] = 7
    path.write_text(json.dumps(bad))
    with pytest.raises(RealtimeError, match="after its op"):
        IdempotenceMap.load(path)
    path.write_text("{")
    with pytest.raises(RealtimeError, match="cannot read"):
        IdempotenceMap.load(path)


def _interrupted_at(model, k: int, restore_from: int) -> torch.Tensor:
    """Ops 0..k-1 done, op k killed halfway (its target half overwritten with garbage), then restored."""
    ws = model.workspace()
    ws.set_input(model.example_input)
    model.run(ws, 0, k)
    op = model.ops[k]
    ws.run_op(k)
    target = ws[op.output if op.output is not None else op.inputs[0]].view(-1)
    if target.is_floating_point():
        target[: max(1, target.numel() // 2)] = float("nan")
    else:
        target[: max(1, target.numel() // 2)] = 7
    model.run(ws, restore_from)
    return ws.output().clone()


@pytest.mark.parametrize("name", ["resnet152", "gpt2"])
def test_restore_from_group_entry_is_exact_at_every_op(tiny_models, name):
    served = tiny_models[name]
    model, ref = served.model, _bits(served.model.infer(served.model.example_input))
    for k in range(len(model)):
        assert _bits(_interrupted_at(model, k, served.imap.entry(k))) == ref, f"op {k} {model.ops[k].name}"


def test_restoring_from_a_non_idempotent_op_itself_is_wrong(tiny_models):
    served = tiny_models["resnet152"]
    model, ref = served.model, _bits(served.model.infer(served.model.example_input))
    wrong = [k for k in range(len(model)) if not served.imap.idempotent[k]
             and _bits(_interrupted_at(model, k, k)) != ref]
    non_idempotent = [k for k in range(len(model)) if not served.imap.idempotent[k]]
    assert wrong == non_idempotent
    # Even without garbage, re-running `out += identity` once more adds identity twice.
    k = next(i for i, op in enumerate(model.ops) if op.name == "add_")
    ws = model.workspace()
    ws.set_input(model.example_input)
    model.run(ws, 0, k + 1)
    model.run(ws, k)
    assert _bits(ws.output()) != ref
